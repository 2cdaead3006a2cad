#!/usr/bin/env bash
# Twenty-second session, call 4 (~2 min on nvidia-h200): the trainer's gpt-1b step under
# --remat dots_attention on 15 of 16 blocks after the trainer stopped holding a second copy of
# the initial weights (call 3: 19.11 GiB in use against 15.40 GiB compiled).
#   bash tools/gpu_session22c.sh
set -u
OUT=${OUT:-/tmp/s22c_out}; R=/tmp/s22c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-200} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=8 step train_dotsattn 180 $PY $GPT1B_TRAIN --remat dots_attention \
  --model remat_layers=15 --run-dir /tmp/s22c_run
cp /tmp/s22c_run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
finish s22c 20
