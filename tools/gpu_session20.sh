#!/usr/bin/env bash
# Twentieth session, call 2 (~8 min on nvidia-h200): issue 6's 1-GPU table with --ablate after the
# bench stopped holding a second reference to each non-donated row's state while timing and
# tracing it (that copy had inflated the baseline's memory swing, at-rest memory and, likely,
# its peak). Same command as tools/gpu_session19b.sh, so the rows compare one to one.
#   bash tools/gpu_session20.sh
set -u
OUT=${OUT:-/tmp/s20_out}; R=/tmp/s20; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=45 step gpt1b_ablate 550 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --ablate --out "$R/gpt1b_ablate"
cp "$R"/gpt1b_ablate/*.png "$OUT/" 2>/dev/null
finish s20 60
