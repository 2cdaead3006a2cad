#!/usr/bin/env bash
# Twenty-second session, call 5 (~3 min on nvidia-h200): gpt-1b through the trainer under a hard
# 16 GiB allocator cap (XLA_PYTHON_CLIENT_MEM_FRACTION = 16 GiB / the GPU's memory), 20 steps with a
# checkpoint, then --resume to step 30: the resume now frees the fresh state before loading.
#   bash tools/gpu_session22d.sh
set -u
OUT=${OUT:-/tmp/s22d_out}; R=/tmp/s22d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-230} TRAIN_STEPS=20
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
cap_memory 16
ARGS="${ARGS:---remat dots_attention --model remat_layers=15} --run-dir /tmp/s22d_run"
STEP_TAIL=6 step train20 110 $PY $GPT1B_TRAIN $ARGS --checkpoint-every 20
STEP_TAIL=6 step resume30 110 $PY -m jaxopt_train.train.cli --run-dir /tmp/s22d_run --resume --steps 30
cp /tmp/s22d_run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
finish s22d 12
