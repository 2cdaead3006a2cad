#!/usr/bin/env bash
# Twenty-fifth session, last call (~6 min on nvidia-h200; 555 s of device time were left):
# gpt-1b's trainer step with XLA's dot and with our kernel (--matmul pallas), whose backward
# was rebuilt from custom_vjp products this session (first-order kernels unchanged); the
# cuDNN remat test that failed once in call 1, twice more with its failure text kept; then
# the kernel GPU tests of gradients and transposes until the deadline.
#   bash tools/gpu_session25b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s25b_out}; R=/tmp/s25b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-370} TRAIN_STEPS=30
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=5 step gpt1b_xla 90 $PY $GPT1B_TRAIN --run-dir /tmp/s25b_x
STEP_TAIL=5 step gpt1b_pallas 100 $PY $GPT1B_TRAIN --matmul pallas --run-dir /tmp/s25b_p
for i in 1 2; do
  STEP_TAIL=3 step remat_cudnn_$i 45 $T tests/test_models.py -k remat_dots_attention_runs_cudnn
done
STEP_TAIL=6 step k_grads 300 $T tests/test_kernels_gpu.py -k "grad or backward or transpose or vjp"
finish s25b 40
