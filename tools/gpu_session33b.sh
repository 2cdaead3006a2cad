#!/usr/bin/env bash
# Thirty-third session, call B (~4 min on nvidia-h200): issue 5's table again, shipped configs:
# the four large shapes and the fused bias+gelu epilogue, Mosaic GPU and Triton against XLA's dot.
#   bash tools/gpu_session33b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33b_out}; R=/tmp/s33b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$R/gpu.txt" 2>&1
STEP_TAIL=40 step mm 450 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --warmup-s 4 \
  --no-layer --json "$R/mm.json"
finish s33b 40
