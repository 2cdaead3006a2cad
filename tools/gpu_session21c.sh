#!/usr/bin/env bash
# Twenty-first session, call 3 (~4 min on nvidia-h200): the 16 GiB gpt-1b row once more after
# two fixes to the remat search that call 2 exposed: its all-blocks runner was still alive while
# the partial one was built (two training states inside the row's peak window: 17.28 GiB), and
# the estimate had no room for what XLA's analysis does not count (~0.3 GiB on this model), so
# the search now keeps 1/32 of the budget (512 MiB at 16 GiB) back.
#   bash tools/gpu_session21c.sh
set -u
OUT=${OUT:-/tmp/s21c_out}; R=/tmp/s21c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-290}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=16 step gpt1b_16g 285 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --memory-budget 16GiB \
  --out "$R/gpt1b_16g"
cp "$R"/gpt1b_16g/train_bench.png "$OUT/gpt1b_16g_train_bench.png" 2>/dev/null
finish s21c 20
