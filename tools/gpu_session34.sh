#!/usr/bin/env bash
# Thirty-fourth session, call A (~8 min on nvidia-h200): the two trainer test files after the
# 8-device pins of session 33 (6cbe2e4, 1613f90, 184c88b), then gpt-1b --matmul xla vs pallas
# with the trainer's frozen collector (66d20e2; not measured on the GPU before), 70 steps each
# logged every 10, and the pallas run once more logged every step (step 32 was 0.27-0.40 s).
#   bash tools/gpu_session34.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s34_out}; R=/tmp/s34; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
step t_trainer 130 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_train.py tests/test_trainer_models.py
G=${GPT1B_TRAIN/--steps 40/--steps 70}
STEP_TAIL=0 step b1_xla1 110 $PY $G --matmul xla --run-dir /tmp/b1_xla1
STEP_TAIL=0 step b1_pallas 160 $PY $G --matmul pallas --run-dir /tmp/b1_pallas
G=${GPT1B_TRAIN/--steps 40/--steps 50}
STEP_TAIL=0 step p_every 130 $PY $G --matmul pallas --log-every 1 --run-dir /tmp/p_every
STEP_TAIL=0 step b1_xla2 80 $PY ${GPT1B_TRAIN/--steps 40/--steps 70} --matmul xla --run-dir /tmp/b1_xla2
for f in b1_xla1 b1_pallas b1_xla2 p_every; do
  echo "$f: $(grep -o "^step [0-9]*\|[0-9.]* s/step" "$R/$f.log" | paste -sd' ' | sed 's/ s\/step//g')"
done | tee "$R/per_step.txt"
finish s34 8
