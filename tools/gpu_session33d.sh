#!/usr/bin/env bash
# Thirty-third session, call D (~4 min on nvidia-h200): both --matmul pallas runs of calls A and C
# slowed over steps 31-40 (0.102-0.111 s against 0.089-0.091), and neither xla run did. Which
# steps, and which kernels? Two 40-step pallas runs logging every step, traced over steps 22-24
# (steady) and 33-35 (the slow interval); then kernel time per step of the second against the first.
#   bash tools/gpu_session33d.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33d_out}; R=/tmp/s33d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500} TRAIN_STEPS=40
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$R/gpu.txt" 2>&1
STEP_TAIL=0 step p_steady 170 $PY $GPT1B_TRAIN --matmul pallas --log-every 1 --profile-steps 22:25 --run-dir /tmp/p_steady
STEP_TAIL=0 step p_slow 120 $PY $GPT1B_TRAIN --matmul pallas --log-every 1 --profile-steps 33:36 --run-dir /tmp/p_slow
for f in p_steady p_slow; do
  echo "$f: $(grep -o "^step [0-9]*\|[0-9.]* s/step" "$R/$f.log" | paste -sd' ' | sed 's/ s\/step//g')" >> "$R/per_step.txt"
done
cat "$R/per_step.txt"
STEP_TAIL=40 step kt 90 $PY -m jaxopt_train.runtime.kernel_time /tmp/p_steady/profile --steps 3 \
  --against /tmp/p_slow/profile --top 25 --json "$R/kt.json"
finish s33d 45
