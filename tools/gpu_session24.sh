#!/usr/bin/env bash
# Twenty-fourth session, call 1 (~6 min on nvidia-h200): the pool check and `--remat auto` in
# their final form (both read step.smallest_pool, the smallest pool over every process), which
# ran on CPU only last session:
# 1. gpt-1b under --memory-limit 12GiB (its step needs 15.4 GiB) must exit 2 before its first step;
# 2. --remat auto under --memory-limit 16GiB: the search should again choose dots_attention on
#    the first 13 blocks and the run keep >= 52% MFU;
# 3. --remat auto without a cap must keep remat off.
#   bash tools/gpu_session24.sh
set -u
OUT=${OUT:-/tmp/s24_out}; R=/tmp/s24; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
unset XLA_PYTHON_CLIENT_PREALLOCATE  # --memory-limit sets it
STEP_TAIL=4 step refuse12 90 $PY $GPT1B_TRAIN --remat dots_attention --model remat_layers=15 \
  --run-dir /tmp/s24_refuse --memory-limit 12GiB
echo "refuse12: $(grep -c 'does not fit the smallest device memory pool' "$R/refuse12.log") refusal line(s) (1 expected)" \
  | tee -a "$R/steps.log"
STEP_TAIL=14 step auto16 220 $PY $GPT1B_TRAIN --remat auto --memory-limit 16GiB --run-dir /tmp/s24_a
cp /tmp/s24_a/config.json "$R/auto16_config.json" 2>/dev/null
STEP_TAIL=10 step auto_uncapped 120 $PY $GPT1B_TRAIN --remat auto --run-dir /tmp/s24_b
finish s24 16
