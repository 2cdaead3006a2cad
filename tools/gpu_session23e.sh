#!/usr/bin/env bash
# Twenty-third session, call 6 (~4 min on nvidia-h200): `jaxopt-train train --remat auto`
# (new: the trainer's own remat search, shared with bench train) on gpt-1b under
# --memory-limit 16GiB, 30 steps: the search should land where bench train's did (dots_attention
# on the first 15 blocks) and the run keep >= 52% MFU; then the same without a cap, where
# "auto" must keep remat off (the H200's pool holds the whole step).
#   bash tools/gpu_session23e.sh
set -u
OUT=${OUT:-/tmp/s23e_out}; R=/tmp/s23e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
unset XLA_PYTHON_CLIENT_PREALLOCATE  # --memory-limit sets it
STEP_TAIL=14 step auto16 220 $PY $GPT1B_TRAIN --remat auto --memory-limit 16GiB --run-dir /tmp/s23e_a
cp /tmp/s23e_a/config.json "$R/auto16_config.json" 2>/dev/null
STEP_TAIL=10 step auto_uncapped 120 $PY $GPT1B_TRAIN --remat auto --run-dir /tmp/s23e_b
finish s23e 16
