#!/usr/bin/env bash
# Thirty-ninth session, call 3 (~3 min): the train step's fp16 micro-batch change (8621c68: under a
# loss scale each micro-batch's loss is divided by K and the gradients multiplied back) on the GPU.
# gpt-124m, fp16, global batch 16, 40 steps: --microbatches 1, --microbatches 4, and --microbatches
# 4 on the step before the change (.whl/step_before.py, from `git show 8621c68^:jaxopt_train/train/step.py`,
# swapped into a copy of the tree). K = 4 is a power of two, so the division and the multiplication
# back are exact unless a value leaves fp16's range: the two K = 4 runs should log the same losses.
#   bash tools/gpu_session39.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s39_out}; R=/tmp/s39; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
rm -rf /tmp/s39_old && mkdir -p /tmp/s39_old && cp -r jaxopt_train /tmp/s39_old/ \
  && cp .whl/step_before.py /tmp/s39_old/jaxopt_train/train/step.py
TRAIN="-m jaxopt_train.train.cli --preset gpt-124m --batch-size 16 --precision fp16 --steps 40 --warmup 5 \
  --log-every 10 --eval-every 0 --checkpoint-every 0 --progress lines --overwrite"
STEP_TAIL=5 step mb1 100 $PY $TRAIN --microbatches 1 --run-dir /tmp/s39_mb1
STEP_TAIL=5 step mb4 100 $PY $TRAIN --microbatches 4 --run-dir /tmp/s39_mb4
(cd /tmp/s39_old && export PYTHONPATH=/tmp/s39_old STEP_TAIL=5 && step mb4_before 100 $PY $TRAIN --microbatches 4 \
  --run-dir /tmp/s39_mb4_before)
for t in mb1 mb4 mb4_before; do
  cp /tmp/s39_$t/metrics.jsonl "$R/metrics_$t.jsonl" 2>/dev/null
  $PY -c "import json,sys; [print(sys.argv[1], r['step'], r['loss'], r['loss_scale'], r['skipped_steps']) for r in map(json.loads, open(sys.argv[2]))]" \
    $t /tmp/s39_$t/metrics.jsonl 2>&1 | tee -a "$R/steps.log"
done
finish s39 8
