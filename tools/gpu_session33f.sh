#!/usr/bin/env bash
# Thirty-third session, call F (~3.5 min on nvidia-h200): the trainer with the collector frozen
# after compiling (train/loop.py), gpt-1b --matmul pallas, 50 steps logged every step: step 32
# took 0.27-0.40 s in calls D and E before the change.
#   bash tools/gpu_session33f.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33f_out}; R=/tmp/s33f; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-200} TRAIN_STEPS=50
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=0 step p_frozen 190 $PY $GPT1B_TRAIN --matmul pallas --log-every 1 --run-dir /tmp/p_frozen
echo "p_frozen: $(grep -o "^step [0-9]*\|[0-9.]* s/step" "$R/p_frozen.log" | paste -sd' ' | sed 's/ s\/step//g')" | tee "$R/per_step.txt"
finish s33f 8
