#!/usr/bin/env bash
# Twenty-fourth session, call 3 (~6 min on nvidia-h200): remat_rest, measured. gpt-1b under
# --memory-limit 14GiB, where dots_attention on every block no longer fits:
# 1. --remat auto: the new search (the fitting policy on k blocks, the one before it on the rest);
# 2. what the old search picked from the same estimates (that policy on k blocks, none on the
#    rest: tools/old_partial_remat.py; k + 1 if k is refused), same cap, for the MFU side by side.
#   bash tools/gpu_session24b.sh
set -u
OUT=${OUT:-/tmp/s24b_out}; R=/tmp/s24b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-520} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
unset XLA_PYTHON_CLIENT_PREALLOCATE  # --memory-limit sets it
CAP=${CAP:-14GiB}
STEP_TAIL=16 step auto 260 $PY $GPT1B_TRAIN --remat auto --memory-limit $CAP --run-dir /tmp/s24b_a
OLD=$($PY tools/old_partial_remat.py "$R/auto.log" 16)
echo "old search: ${OLD:-(same as the new one)}" | tee -a "$R/steps.log"
if [ -n "$OLD" ]; then
  STEP_TAIL=8 step old 120 $PY $GPT1B_TRAIN $OLD --memory-limit $CAP --run-dir /tmp/s24b_b
  if grep -q "does not fit the smallest device memory pool" "$R/old.log"; then
    OLD=$($PY tools/old_partial_remat.py "$R/auto.log" 16 +1)
    echo "old search, k + 1: $OLD" | tee -a "$R/steps.log"
    STEP_TAIL=8 step old_k1 120 $PY $GPT1B_TRAIN $OLD --memory-limit $CAP --run-dir /tmp/s24b_c
  fi
fi
finish s24b 30
