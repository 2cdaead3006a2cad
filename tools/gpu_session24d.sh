#!/usr/bin/env bash
# Twenty-fourth session, call 5 (~4 min on nvidia-h200), after the audit fixes (loop stop
# agreement, model state carrying RNG streams, optimizer init under jit, bf16 state scalars):
# the GPU tests outside the kernels, then gpt-1b's trainer step (30 steps, bf16 grads and
# moments), whose MFU must match the morning's (55.1-55.5%).
#   bash tools/gpu_session24d.sh
set -u
OUT=${OUT:-/tmp/s24d_out}; R=/tmp/s24d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-230} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=6 step others 100 $T tests --ignore=tests/test_kernels_gpu.py
STEP_TAIL=6 step gpt1b 100 $PY $GPT1B_TRAIN --run-dir /tmp/s24d_a
finish s24d 14
