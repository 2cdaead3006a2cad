#!/usr/bin/env bash
# Twenty-fourth session, call 4 (~5 min on nvidia-h200): call 3's two choices under
# --memory-limit 14GiB at the steady state, alternated, 50 steps each, twice:
# new (full on 5 blocks, dots on the rest) and old (full on 8 blocks, none on the rest).
#   bash tools/gpu_session24c.sh
set -u
OUT=${OUT:-/tmp/s24c_out}; R=/tmp/s24c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400} TRAIN_STEPS=50
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
unset XLA_PYTHON_CLIENT_PREALLOCATE  # --memory-limit sets it
NEW="--remat full --model remat_layers=5 --model remat_rest=dots"
OLD="--remat full --model remat_layers=8"
for i in 1 2; do
  STEP_TAIL=6 step new$i 90 $PY $GPT1B_TRAIN $NEW --memory-limit 14GiB --run-dir /tmp/s24c_n$i
  STEP_TAIL=6 step old$i 90 $PY $GPT1B_TRAIN $OLD --memory-limit 14GiB --run-dir /tmp/s24c_o$i
done
finish s24c 30
