#!/usr/bin/env bash
# Prepared in the twenty-second session for the next one (~5 min on nvidia-h200): the trainer's
# gpt-1b under a hard 16 GiB allocator cap after the optimizer-init fix (its f32 moments left a
# 6.8 GiB hole in the pool). First the stage-by-stage memory probe for each remat choice, then
# the capped train + resume of tools/gpu_session22d.sh with the best choice that fitted.
#   bash tools/gpu_session23.sh
set -u
OUT=${OUT:-/tmp/s23_out}; R=/tmp/s23; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
cap_memory 16
FLAGS="--preset gpt-1b --batch-size 8 --precision bf16 --grad-dtype compute --opt-state-dtype bf16 --steps 3"
STEP_TAIL=8 step mem_dotsattn15 90 $PY tools/probe_trainer_memory.py $FLAGS --remat dots_attention --model remat_layers=15
STEP_TAIL=8 step mem_dotsattn16 90 $PY tools/probe_trainer_memory.py $FLAGS --remat dots_attention
STEP_TAIL=8 step mem_dots16 90 $PY tools/probe_trainer_memory.py $FLAGS --remat dots
ARGS="--remat dots_attention --model remat_layers=15" DEADLINE=150 \
  OUT=$R/capped bash "$(dirname "$0")/gpu_session22d.sh"
finish s23 12
