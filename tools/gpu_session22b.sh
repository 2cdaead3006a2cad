#!/usr/bin/env bash
# Twenty-second session, call 3 (~6 min on nvidia-h200):
# 1. issue 6's 1-GPU gpt-1b table (no memory budget: no remat) on this tree, to check that the
#    attention output's checkpoint name (an identity outside remat) left the headline step alone;
# 2. the trainer's own gpt-1b step under --remat dots_attention on 15 of 16 blocks (the 16 GiB
#    row's choice), 30 steps, so the new policy runs through the trainer on cuDNN too.
#   bash tools/gpu_session22b.sh
set -u
OUT=${OUT:-/tmp/s22b_out}; R=/tmp/s22b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-450} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=16 step gpt1b 250 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --out "$R/gpt1b"
cp "$R"/gpt1b/train_bench.png "$OUT/gpt1b_train_bench.png" 2>/dev/null
STEP_TAIL=8 step train_dotsattn 180 $PY $GPT1B_TRAIN --remat dots_attention \
  --model remat_layers=15 --run-dir "$R/run_dotsattn"
finish s22b 20
