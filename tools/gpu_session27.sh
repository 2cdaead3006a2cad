#!/usr/bin/env bash
# Twenty-seventh session, call A (~5 min on nvidia-h200): the gpt-1b trainer step (XLA's dot),
# a gpt-tiny run with 2 micro-batches that evaluates (Trainer.evaluate now runs the step's
# micro-batches itself) and checkpoints at the same steps (saved before the eval now), resumed;
# a Mosaic GPU autotune of a transposed layout (only configs that read it as stored are timed);
# then every GPU test outside tests/test_kernels_gpu.py.
#   bash tools/gpu_session27.sh   # carry [".whl"]
# Call B is `TRITON=1 bash tools/gpu_session18b.sh` (every kernel GPU test).
set -u
OUT=${OUT:-/tmp/s27_out}; R=/tmp/s27; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
TINY="-m jaxopt_train.train.cli --preset gpt-tiny --batch-size 16 --microbatches 2 --log-every 10 \
  --eval-every 10 --checkpoint-every 10 --progress lines --run-dir /tmp/s27_tiny"
STEP_TAIL=5 step gpt1b_xla 120 $PY $GPT1B_TRAIN --run-dir /tmp/s27_x
STEP_TAIL=4 step tiny_first 60 $PY $TINY --steps 20 --overwrite
STEP_TAIL=4 step tiny_resume 60 $PY $TINY --steps 30 --resume
STEP_TAIL=6 step autotune_bT 90 env JAXOPT_TRAIN_CACHE_DIR=$R/cache $PY -m jaxopt_train.kernels.autotune \
  --backend mosaic_gpu --quick --transposed b --shapes 2048x2048x2048 --budget-s 20
cp -r $R/cache "$R/cache_copy" 2>/dev/null
STEP_TAIL=8 step others 200 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests --ignore=tests/test_kernels_gpu.py
finish s27 30
