#!/usr/bin/env bash
# Thirty-sixth session, call A (~8 min on nvidia-h200): bench train --precision fp16 (e621e14)
# on the GPU: its GPU test, then the issue-6 gpt-1b table in fp16 and in bf16, one after the
# other in this call (same machine, same clocks), and the GPU tests of the models (cuDNN's
# head_dim limit now read from this process's GPUs, 7a22b44).
#   bash tools/gpu_session36.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s36_out}; R=/tmp/s36; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
STEP_TAIL=4 step t_gpu 150 $PY -m pytest -q -rfE -p no:cacheprovider -m gpu \
  tests/test_bench_precision.py tests/test_models.py tests/test_models_edges.py
STEP_TAIL=16 step gpt1b_fp16 200 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --precision fp16 --out $R/gpt1b_fp16
STEP_TAIL=16 step gpt1b_bf16 200 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --precision bf16 --out $R/gpt1b_bf16
for v in fp16 bf16; do cp $R/gpt1b_$v/train_bench.json "$OUT/gpt1b_$v.json" 2>/dev/null; done
finish s36 16
