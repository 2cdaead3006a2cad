#!/usr/bin/env bash
# Twenty-ninth session, call D (~1.5 min on nvidia-h200): the gpt-124m run whose step time grew
# 0.044 -> 0.088 s over 800 steps (calls B, C), with the vocabulary cut to the 256 byte ids the
# data uses: does the growth go with the 50,048 rows the data never uses?
#   bash tools/gpu_session29c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s29c_out}; R=/tmp/s29c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-140}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
G="-m jaxopt_train.train.cli --preset gpt-124m --steps ${GSTEPS:-800} --batch-size 16 --warmup 100 \
  --lr 6e-4 --log-every 100 --eval-every 0 --eval-batches 1 --checkpoint-every 0 --progress lines \
  --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute"
STEP_TAIL=9 step growth_vocab256 130 $PY $G --model vocab_size=256 --run-dir /tmp/g_v256
finish s29c 12
