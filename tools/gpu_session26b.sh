#!/usr/bin/env bash
# Twenty-sixth session, last call (~9.5 min on nvidia-h200): the final tree's gpt-1b trainer
# step (XLA's dot; the loop now evaluates in micro-batches and records the data order), a
# gpt-tiny run with 2 micro-batches resumed for 10 more steps (the new resume checks on GPU),
# then every one-GPU test (tools/gpu_session18b.sh, Triton included) until the deadline.
#   bash tools/gpu_session26b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s26b_out}; R=/tmp/s26b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-585} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
TINY="-m jaxopt_train.train.cli --preset gpt-tiny --batch-size 16 --microbatches 2 --log-every 10 \
  --eval-every 10 --checkpoint-every 10 --progress lines --run-dir /tmp/s26b_tiny"
STEP_TAIL=5 step gpt1b_xla 110 $PY $GPT1B_TRAIN --run-dir /tmp/s26b_x
STEP_TAIL=4 step tiny_first 60 $PY $TINY --steps 20 --overwrite
STEP_TAIL=4 step tiny_resume 60 $PY $TINY --steps 30 --resume
STEP_TAIL=4 step tiny_refused 30 $PY $TINY --steps 40 --resume --batch-size 32
left=$(( t0 + DEADLINE - $(date +%s) ))
DEADLINE=$left OUT=$OUT TRITON=1 bash "$(dirname "$0")/gpu_session18b.sh"
cp /tmp/s18b/steps.log "$R/s18b_steps.log" 2>/dev/null
finish s26b 40
