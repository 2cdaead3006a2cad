#!/usr/bin/env bash
# For the ninth session's first call (nvidia-h200-x2, ~7 min, carry [".whl"]): what the eighth
# session changed after its device time ran out, checked on the GPUs.
#   both GPUs: the GPU tests of the modules the bad-input sweep touched (collectives, models,
#              bench train; the kernels' own tests passed before the sweep: 207 of 207);
#   GPU 0:     gpt-1b's default step (tools/probe_gpt1b.py optcopy) with the cross-entropy and
#              embedding NaN guards now in the model: 86.2 ms before them (84.1-87.0 by burst);
#   GPU 1:     bench matmul's issue 5 rows (the kernel is unchanged: a fresh sample).
#   bash tools/gpu_next8.sh   # results in $OUT/next8.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/next8_out}; R=/tmp/next8; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-450}
source "$(dirname "$0")/gpu_common.sh"
step tests 150 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_collectives_gpu.py \
  tests/test_models.py tests/test_bench_train.py
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$R step probe ${T_P:-150} $PY tools/probe_gpt1b.py --variants optcopy --tag _guards
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step bench_matmul ${T_MM:-240} $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
    --calls 10 --bursts 3 --warmup-s 0.3 --json "$R/matmul.json"
) & B=$!
wait $A $B
finish next8 30
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
