#!/usr/bin/env bash
# Twenty-third session, call 4 (~6 min on nvidia-h200), after the call-3 commits:
# 1. the GPU tests outside the kernel modules (models, bench, doctor, monitor, memory);
# 2. the Trainer's new refusal of a step that cannot fit its pool: gpt-1b under
#    --memory-limit 12GiB (its step needs 15.4 GiB) must exit 2 before its first step;
# 3. ZeRO-3 evaluation, which now gathers inside its step: gpt-tiny at --zero 0 and --zero 3 on
#    one GPU, same seed, eval every 20 steps (the losses must agree);
# 4. the trainer's gpt-1b memory without the initial-weights copy it held until the
#    twenty-second session (README's 27.9 / 24.6 GiB included it): defaults, then bf16
#    gradients and moments, 30 steps each, no remat.
#   bash tools/gpu_session23d.sh
set -u
OUT=${OUT:-/tmp/s23d_out}; R=/tmp/s23d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-480} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=6 step others 100 $T tests --ignore=tests/test_kernels_gpu.py
STEP_TAIL=4 step refuse12 90 env -u XLA_PYTHON_CLIENT_PREALLOCATE $PY $GPT1B_TRAIN --remat dots_attention \
  --model remat_layers=15 --run-dir /tmp/s23d_refuse --memory-limit 12GiB
echo "refuse12 exit status (2 expected): $(grep -c 'does not fit the memory pool' "$R/refuse12.log") refusal line(s)" \
  | tee -a "$R/steps.log"
TINY="-m jaxopt_train.train.cli --preset gpt-tiny --steps 60 --eval-every 20 --log-every 20 --progress lines --overwrite"
STEP_TAIL=5 step tiny_zero0 60 $PY $TINY --zero 0 --run-dir /tmp/s23d_z0
STEP_TAIL=5 step tiny_zero3 60 $PY $TINY --zero 3 --run-dir /tmp/s23d_z3
STEP_TAIL=6 step gpt1b_default 100 $PY $GPT1B_TRAIN --grad-dtype param --opt-state-dtype f32 --run-dir /tmp/s23d_a
STEP_TAIL=6 step gpt1b_bf16 100 $PY $GPT1B_TRAIN --run-dir /tmp/s23d_b
finish s23d 12
