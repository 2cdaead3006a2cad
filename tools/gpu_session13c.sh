#!/usr/bin/env bash
# Thirteenth session, call 5 (nvidia-h200-x2, ~4 min): call 4 found the fused MLP step slower
# than the unfused one and its test step ran out of time before the new tests. GPU 0: the new
# saved-pre-activation tests; GPU 1: profiles of the `--matmul pallas` step, fused (`opt`) then
# unfused (`optnofuse`), kernel by kernel (probe_gpt1b --profile, 5 s warm-up).
# As run (commit e675219) the fused MLP was GPTConfig's default (`opt`); it is `optfuse` now.
#   bash tools/gpu_session13c.sh   # results in $OUT/summary.txt, $OUT/prof_*.json
set -u
OUT=${OUT:-/tmp/s13c_out}; R=/tmp/s13c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-250}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
CUDA_VISIBLE_DEVICES=0 step tests 200 $T tests/test_kernels_gpu.py -k preactivation & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for v in opt optnofuse; do
    OUT=$R step "prof_$v" 115 $PY tools/probe_gpt1b.py --variants $v --profile --warmup-s 5 \
      --tag "_prof_$v" --matmul pallas
  done
) & B=$!
wait $A $B
for v in opt optnofuse; do cp "$R/gpt1b_probe_prof_$v.json" "$OUT/prof_$v.json" 2>/dev/null; done
finish s13c 20 --exclude=*.trace.json.gz --exclude=hlo_* --exclude=trace_*
