#!/usr/bin/env bash
# Twenty-eighth session, call A (~9 min on nvidia-h200): `jaxopt-train train --remat auto` on
# gpt-1b under --memory-limit 16GiB, 30 steps (the partial search now redraws its line through
# each block count that misses; the trainer's fit check agrees across processes), then the same
# without a cap (auto must keep remat off), then every GPU test outside tests/test_kernels_gpu.py.
#   bash tools/gpu_session28.sh   # carry [".whl"]
# Call B is `TRITON=1 bash tools/gpu_session18b.sh` (every kernel GPU test).
set -u
OUT=${OUT:-/tmp/s28_out}; R=/tmp/s28; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-580} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee -a "$R/steps.log"
unset XLA_PYTHON_CLIENT_PREALLOCATE  # --memory-limit sets it
STEP_TAIL=14 step auto16 230 $PY $GPT1B_TRAIN --remat auto --memory-limit 16GiB --run-dir /tmp/s28_a
cp /tmp/s28_a/config.json "$R/auto16_config.json" 2>/dev/null
export XLA_PYTHON_CLIENT_PREALLOCATE=false
STEP_TAIL=10 step auto_uncapped 120 $PY $GPT1B_TRAIN --remat auto --run-dir /tmp/s28_b
STEP_TAIL=8 step others 200 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests --ignore=tests/test_kernels_gpu.py
finish s28 30
