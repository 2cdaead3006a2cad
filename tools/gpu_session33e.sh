#!/usr/bin/env bash
# Thirty-third session, call E (~4 min on nvidia-h200): call D found one step, step 32, taking
# 0.27-0.29 s in --matmul pallas runs (0.09 s the others; no such step with xla). Is it Python's
# generation-2 garbage collection walking the objects the Mosaic GPU lowering left alive?
# The pallas run with every gen-2 collection logged, then again with gc.freeze() after compiling.
#   bash tools/gpu_session33e.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33e_out}; R=/tmp/s33e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400} TRAIN_STEPS=40
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
A=${GPT1B_TRAIN#-m jaxopt_train.train.cli }
STEP_TAIL=0 step gc_log 170 $PY tools/gc_probe.py $A --matmul pallas --log-every 1 --run-dir /tmp/gc_log
STEP_TAIL=0 step gc_freeze 100 $PY tools/gc_probe.py --gc-freeze $A --matmul pallas --log-every 1 --run-dir /tmp/gc_freeze
STEP_TAIL=0 step gc_xla 150 $PY tools/gc_probe.py $A --matmul xla --log-every 1 --run-dir /tmp/gc_xla
for f in gc_log gc_freeze gc_xla; do
  echo "$f: $(grep -o "^step [0-9]*\|[0-9.]* s/step" "$R/$f.log" | paste -sd' ' | sed 's/ s\/step//g')"
  grep "^gc " "$R/$f.log"
done | tee "$R/summary_steps.txt"
finish s33e 12
