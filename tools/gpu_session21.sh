#!/usr/bin/env bash
# Twenty-first session, call 1 (~9 min on nvidia-h200): issue 6's gpt-1b-within-16-GiB table and
# the resnet50 table, re-measured after the twentieth session's bench fix (the baseline row no
# longer holds a second reference to its state while it is timed, which had inflated its peak
# memory and its memory swing). Same commands as BENCHMARKS.md's tables, plus the 15 s warm-up
# every bench row has had since the twelfth session, so the step times compare one to one.
#   bash tools/gpu_session21.sh
set -u
OUT=${OUT:-/tmp/s21_out}; R=/tmp/s21; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-575}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$R/gpu.log" 2>&1
STEP_TAIL=14 step gpt1b_16g 300 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --memory-budget 16GiB \
  --out "$R/gpt1b_16g"
STEP_TAIL=14 step resnet50 260 $PY -m jaxopt_train.bench.train --model resnet50 --global-batch 256 \
  --steps 30 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --dataset-tokens 1281167 \
  --warmup-s 15 --no-scaling --out "$R/resnet50"
cp "$R"/gpt1b_16g/train_bench.png "$OUT/gpt1b_16g_train_bench.png" 2>/dev/null; for f in "$R"/resnet50/*.png; do cp "$f" "$OUT/resnet50_$(basename "$f")"; done 2>/dev/null
finish s21 30
