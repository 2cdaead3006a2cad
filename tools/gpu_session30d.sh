#!/usr/bin/env bash
# Thirtieth session, call D (~5 min on nvidia-h200): gpt-124m on the embedded corpus for 1,500
# steps (the twenty-ninth session's quality run), before (OLD_TAR: nnx.Embed, bf16 scatter-add)
# and after the f32-summed embedding gradient: time per 100 steps and the eval loss.
#   OLD_TAR=.whl/old.tar bash tools/gpu_session30d.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s30d_out}; R=/tmp/s30d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
G="-m jaxopt_train.train.cli --preset gpt-124m --steps 1500 --batch-size 16 --warmup 100 \
  --lr 6e-4 --log-every 100 --eval-every 500 --eval-batches 8 --checkpoint-every 0 --progress lines \
  --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute"
STEP_TAIL=18 step q_new 140 $PY $G --run-dir /tmp/q_new
mkdir -p /tmp/old && tar -xf "${OLD_TAR:-.whl/old.tar}" -C /tmp/old
(cd /tmp/old && export PYTHONPATH=/tmp/old && STEP_TAIL=18 step q_old 180 $PY $G --run-dir /tmp/q_old)
finish s30d 20
