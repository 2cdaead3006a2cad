#!/usr/bin/env bash
# Issue 6's 2-GPU table with ZeRO-1 (per-leaf sharded master weights and AdamW state,
# bf16 params all-gathered at the step's start, gradients reduce-scattered) against the
# replicated step, on both GPUs of the lent nvidia-h200-x2, one bench process each (the
# bench reruns the optimised config on one GPU in the same process: the scaling row).
#   bash tools/gpu_zero.sh   # results in $OUT/zero.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/zero_out}; R=/tmp/zero; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
for z in ${ZERO_ORDER:-1 0}; do
  step "zero$z" ${T_BENCH:-270} $PY $GPT1B_BENCH --global-batch 16 --zero "$z" --out "$R/zero$z"
done
finish zero 40
