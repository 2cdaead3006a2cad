#!/usr/bin/env bash
# Eighteenth session, call 4 (~4 min on nvidia-h200): Triton's >= 0.95x at 8192^3 has read
# 0.978x and 0.947x with the four-stage tile, one process each, and these ratios move ~3%
# between processes. Four more fresh processes, each timing XLA's dot, Mosaic GPU and Triton
# at 8192^3 only (plain and fused), give the spread across processes instead of one draw.
#   bash tools/gpu_session18d.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s18d_out}; R=/tmp/s18d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/nocache
for i in 1 2 3 4; do
  STEP_TAIL=0 step "mm8k_$i" 75 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton \
    --warmup-s 4 --no-layer --shapes 8192x8192x8192 --json "$R/mm8k_$i.json"
  grep -h "^8192x8192x8192" "$R/mm8k_$i.log"
done
cp "$R"/mm8k_*.json "$OUT/" 2>/dev/null
finish s18d 20
