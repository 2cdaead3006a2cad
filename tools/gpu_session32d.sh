#!/usr/bin/env bash
# Thirty-second session, call D (~3 min on nvidia-h200): bench matmul now times its first
# shape once with XLA's dot and throws it away. Does XLA's first row stop sagging? The small
# shapes in the default order (1024^3 first: 13.6 TFLOP/s in call B), then 8192^3 alone
# (issue 5's headline shape, always first in a default run).
#   bash tools/gpu_session32d.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s32d_out}; R=/tmp/s32d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
STEP_TAIL=14 step mm_small 130 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --no-fused --no-layer \
  --shapes 1024x1024x1024,2048x512x2048,1000x777x513,3000x5000x1000 --json $R/mm_small.json
STEP_TAIL=5 step mm_8192 150 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --no-fused --no-layer \
  --warmup-s 4 --shapes 8192x8192x8192 --json $R/mm_8192.json
finish s32d 25
