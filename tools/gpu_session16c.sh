#!/usr/bin/env bash
# Sixteenth session, third device call (one nvidia-h200, ~6 min).
# 1. tools/probe_tma_pad.py: the same kernel with TMA covering partial tiles against the
#    earlier whole-tile padding, next to XLA's dot.
# 2. The 47 kernel GPU tests call 2 had no time for (the last 47 of tools/gpu16b_tests.txt: odd-shape
#    transposes, several tiles per SM, gradients, the tied head) on the new wrapper.
# 3. bench matmul (no cache) with the revised small-grid rule (<= 33 CTAs halve the tile).
#   bash tools/gpu_session16c.sh   # carry [".whl"]; $OUT/summary.txt, $OUT/mm.json, $OUT/tma_pad.json
set -u
OUT=${OUT:-/tmp/s16c_out}; R=/tmp/s16c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
export JAXOPT_TRAIN_CACHE_DIR=$R/nocache
STEP_TAIL=8 step tma_pad 90 $PY tools/probe_tma_pad.py
STEP_TAIL=14 step mm 110 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu --warmup-s 3 \
  --no-fused --no-layer --json "$OUT/mm.json" \
  --shapes 2048x512x2048,1024x1024x4096,768x768x3072,1024x2048x4096,2048x1024x2048,3000x4096x1024
step kernels 240 $T $(tail -n +61 tools/gpu16b_tests.txt)
finish s16c 25
