#!/usr/bin/env bash
# Eleventh session, call 5 (nvidia-h200-x2, <= 5 min): the non-kernel GPU tests, whose collection
# failed in call 4 (tests/test_zero.py built an 8-device mesh at import; fixed), then the bench's
# default 2-GPU gpt-1b table once more (issue 6's scaling: 95.8%, 95.4% and 94.8% so far).
#   bash tools/gpu_session11e.sh   # results in $OUT/summary.txt and $OUT/gpt1b_x2_b.{md,json}
set -u
OUT=${OUT:-/tmp/s11e_out}; R=/tmp/s11e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
CUDA_VISIBLE_DEVICES=0 step others 100 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests \
  --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
step gpt1b_x2_b 190 $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --out "$R/gpt1b_x2_b"
finish s11e 30
cp "$R/gpt1b_x2_b/train_bench.md" "$OUT/gpt1b_x2_b.md" 2>/dev/null; cp "$R/gpt1b_x2_b/train_bench.json" "$OUT/gpt1b_x2_b.json" 2>/dev/null
rm -f "$OUT/s11e.tar.gz"
