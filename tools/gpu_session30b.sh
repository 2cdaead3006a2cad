#!/usr/bin/env bash
# Thirtieth session, call B (~9 min on nvidia-h200): the embedding lookup whose gradient is summed
# in f32 (models/embedding.py), after call A found the bf16 scatter-add of nnx.Embed's gradient
# growing from 13.8 to 49 ms per gpt-124m step.
#   g_new     call A's growing gpt-124m run on this tree, traced at steps 650-652 (compare k_late)
#   b1_old / b1_new  gpt-1b trainer, 200 steps, on the previous tree (OLD_TAR) and on this one
#   gpt1b     the issue-6 one-GPU table (bench train) on this tree
#   OLD_TAR=.whl/old.tar bash tools/gpu_session30b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s30b_out}; R=/tmp/s30b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570} TRAIN_STEPS=200
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
G="-m jaxopt_train.train.cli --preset gpt-124m --steps 700 --batch-size 16 --warmup 100 \
  --log-every 50 --eval-every 0 --eval-batches 1 --checkpoint-every 0 --progress lines \
  --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute --lr 6e-4"
STEP_TAIL=16 step g_new 150 $PY $G --profile-steps 650:653 --run-dir /tmp/g_new
$PY -m jaxopt_train.runtime.kernel_time /tmp/g_new/profile --steps 3 --json "$R/new_late.json" > "$R/k_new_late.log" 2>&1
head -8 "$R/k_new_late.log"
mkdir -p /tmp/old && tar -xf "${OLD_TAR:-.whl/old.tar}" -C /tmp/old
B1="$GPT1B_TRAIN --log-every 50"
(cd /tmp/old && export PYTHONPATH=/tmp/old && STEP_TAIL=6 step b1_old 150 $PY $B1 --run-dir /tmp/b1_old)
STEP_TAIL=6 step b1_new 150 $PY $B1 --run-dir /tmp/b1_new
STEP_TAIL=16 step gpt1b 250 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --out "$R/gpt1b"
cp "$R"/gpt1b/train_bench.png "$OUT/gpt1b_train_bench.png" 2>/dev/null
finish s30b 24
