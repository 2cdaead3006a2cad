#!/usr/bin/env bash
# Twentieth session, call 3 (~6 min on nvidia-h200): the --compare-plain rows (a careful plain
# Flax + optax loop, f32 master and pure bf16) with their memory window opened before their
# runner holds its state; until this session their peaks counted that state twice.
#   bash tools/gpu_session20b.sh
set -u
OUT=${OUT:-/tmp/s20b_out}; R=/tmp/s20b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=30 step gpt1b_plain 550 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --compare-plain --out "$R/gpt1b_plain"
finish s20b 40
