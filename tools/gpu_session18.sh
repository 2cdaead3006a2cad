#!/usr/bin/env bash
# Prepared in the seventeenth session for the next device call (~9 min on nvidia-h200).
# 1. The seventeenth session shipped a fourth pipeline stage in Triton's Hopper tile
#    (configs._HOPPER_TRITON) after its device time was spent: run every Triton GPU test on it
#    (40 tests), then gpt-1b's optimised step with --matmul triton (fused MLP, the new default
#    there) against 92.86 ms with three stages (seventeenth session, call 5); then
#    tools/probe_triton_align.py: the wrapper's new 16-byte row padding against none.
# 2. On two GPUs only (GPUS="0 1", nvidia-h200-x2): the 2-GPU bench train table (issue 6's
#    scaling target), last measured in the thirteenth session.
#   bash tools/gpu_session18.sh   # carry [".whl"]; GPUS="0 1" on nvidia-h200-x2
set -u
OUT=${OUT:-/tmp/s18_out}; R=/tmp/s18; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
GPUS=${GPUS:-0}
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
STEP_TAIL=15 step k_triton 240 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/test_kernels_gpu.py -k triton
STEP_TAIL=8 OUT=$R step probe_triton 150 $PY tools/probe_gpt1b.py --variants opt --warmup-s 10 \
  --tag _triton --matmul triton
cp "$R/gpt1b_probe_triton.json" "$OUT/" 2>/dev/null
# The Triton wrapper's 16-byte row padding (seventeenth session, landed unmeasured: the sm_90
# IR showed unpipelined loads without it). Library call against align=False, XLA beside them.
STEP_TAIL=8 OUT=$R step align 150 $PY tools/probe_triton_align.py
cp "$R/triton_align.json" "$OUT/" 2>/dev/null
if [ "$GPUS" != "0" ]; then
  export CUDA_VISIBLE_DEVICES=0,1
  STEP_TAIL=14 step bench2 240 $PY $GPT1B_BENCH --global-batch 16 --warmup-s 15 \
    --out "$OUT/gpt1b_2gpu"
fi
finish s18 25
