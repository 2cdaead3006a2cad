#!/usr/bin/env bash
# Thirty-third session, call C (~6 min on nvidia-h200): call A's --matmul pallas run slowed to
# 0.111 s/step over its last 10 steps, which neither XLA run did. The same two runs, 70 steps
# each, xla then pallas then xla again (a drift of the GPU shows in both xla runs), and the
# trainer tests of commit 6ce2532 (the NNX loss's batch in the output dtype) on one GPU.
#   bash tools/gpu_session33c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33c_out}; R=/tmp/s33c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540} TRAIN_STEPS=70
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$R/gpu.txt" 2>&1
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=5 step t_trainer 90 $T tests/test_trainer_models.py tests/test_precision_edges.py
for run in xla1:xla pallas:pallas xla2:xla; do
  STEP_TAIL=9 step "b1_${run%%:*}" 140 $PY $GPT1B_TRAIN --matmul "${run##*:}" --run-dir "/tmp/b1_${run%%:*}"
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> "$R/gpu.txt" 2>&1
done
finish s33c 20
