#!/usr/bin/env bash
# Twenty-third session, call 2 (~4 min on nvidia-h200). Call 1 (tools/gpu_session23.sh) ran the
# trainer's gpt-1b under a 16 GiB cap with a pool that grows on demand: "dots" fitted, but
# dots_attention (8.61 GiB of temporaries on 15 blocks) did not, with 8.85 GiB free and a largest
# free block of 7.94 GiB. A growing pool is made of regions and no buffer spans two of them. Here
# the same cap is reserved up front as one region (XLA's default, as on a 16 GiB GPU): the probe,
# then 20 steps with a checkpoint and --resume to 30.
#   bash tools/gpu_session23b.sh
set -u
OUT=${OUT:-/tmp/s23b_out}; R=/tmp/s23b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300} CAP_PREALLOCATE=true
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
cap_memory 16
FLAGS="--preset gpt-1b --batch-size 8 --precision bf16 --grad-dtype compute --opt-state-dtype bf16 --steps 3"
STEP_TAIL=8 step mem_dotsattn15 90 $PY tools/probe_trainer_memory.py $FLAGS --remat dots_attention --model remat_layers=15
ARGS="--remat dots_attention --model remat_layers=15" DEADLINE=200 \
  OUT=$R/capped bash "$(dirname "$0")/gpu_session22d.sh"
finish s23b 12
