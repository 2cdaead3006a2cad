#!/usr/bin/env bash
# Twenty-sixth session, one GPU (~5 min, two pytest processes): the new second-derivative GPU tests (one layer and
# three layers through lax.scan, mosaic_gpu and triton against xla) and the first-order
# gradient tests and every relu test (relu is max(x, 0) now), on the tree without
# constant-only values in the kernels primal (lax.pad, slice placeholders).
#   bash tools/gpu_session26.sh   # carry [".whl"] so the Triton cases run
set -u
OUT=${OUT:-/tmp/s26_out}; R=/tmp/s26; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-480}
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=8 step second 450 $T tests/test_kernels_gpu.py -k second &
STEP_TAIL=8 step others 450 $T tests/test_kernels_gpu.py -k "(relu or gradients_match or saved_preactivation) and not second" &
wait
finish s26 40
