#!/usr/bin/env bash
# Nineteenth session, call 2 (~8 min on nvidia-h200): issue 6's 1-GPU table with --ablate at the
# power-capped steady state (15 s warm-up per config, the default since the twelfth session). The
# ablation table in BENCHMARKS.md dates from the second session, timed cold and before the bf16
# weight copy became the default.
#   bash tools/gpu_session19b.sh
set -u
OUT=${OUT:-/tmp/s19b_out}; R=/tmp/s19b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=45 step gpt1b_ablate 540 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --ablate --out "$R/gpt1b_ablate"
cp "$R"/gpt1b_ablate/*.png "$OUT/" 2>/dev/null
finish s19b 60
