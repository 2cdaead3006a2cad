#!/usr/bin/env bash
# Twenty-ninth session, call C (~4 min on nvidia-h200): does flush-to-zero stop the trainer's
# step time from growing? tools/probe_denormal.py with and without --xla_gpu_ftz=true, then the
# gpt-124m run of call B (which went 0.044 -> 0.088 s/step over 800 steps) with it.
#   bash tools/gpu_session29b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s29b_out}; R=/tmp/s29b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=2 step denormal_default 60 $PY tools/probe_denormal.py
STEP_TAIL=2 step denormal_ftz 60 env XLA_FLAGS=--xla_gpu_ftz=true $PY tools/probe_denormal.py
G="-m jaxopt_train.train.cli --preset gpt-124m --steps ${GSTEPS:-800} --batch-size 16 --warmup 100 \
  --lr 6e-4 --log-every 100 --eval-every 0 --eval-batches 1 --checkpoint-every 0 --progress lines \
  --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute"
STEP_TAIL=9 step growth_ftz 130 env XLA_FLAGS=--xla_gpu_ftz=true $PY $G --run-dir /tmp/g_ftz
finish s29b 12
