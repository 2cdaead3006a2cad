#!/usr/bin/env bash
# Twenty-third session, call 3 (~4 min on nvidia-h200): the trainer's new --memory-limit flag
# (runtime.limit_memory, preallocated) instead of the environment variables of call 2: gpt-1b,
# dots_attention on the first 15 blocks, 40 steps with a checkpoint (steady-state MFU at steps
# 20, 30, 40 under the cap), then --resume to 50 under the same cap; and the GPU memory tests.
#   bash tools/gpu_session23c.sh
set -u
OUT=${OUT:-/tmp/s23c_out}; R=/tmp/s23c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330} TRAIN_STEPS=40
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
unset XLA_PYTHON_CLIENT_PREALLOCATE  # the flag sets it
CAP="--memory-limit 16GiB"
STEP_TAIL=8 step memory_gpu 60 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_runtime_memory.py
ARGS="--remat dots_attention --model remat_layers=15 --run-dir /tmp/s23c_run"
STEP_TAIL=8 step train40 130 $PY $GPT1B_TRAIN $ARGS $CAP --checkpoint-every 40
STEP_TAIL=6 step resume50 110 $PY -m jaxopt_train.train.cli --run-dir /tmp/s23c_run --resume --steps 50 $CAP
cp /tmp/s23c_run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
finish s23c 12
