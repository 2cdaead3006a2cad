#!/usr/bin/env bash
# Every GPU-marked test on the tree (nvidia-h200-x2, ~6-9 min); ran as the eighth session's call 5
# (as gpu_session8d.sh) and the eleventh session's call 4 (as gpu_session11d.sh).
#   GPU 0: kernel tests except Triton and the option sweeps, then the other modules' GPU tests;
#   GPU 1: Triton and option-sweep kernel tests (jax-triton from .whl on PYTHONPATH);
#   both:  tests/test_collectives_gpu.py (needs the pair).
#   bash tools/gpu_all_tests.sh   # with carry [".whl"] (jax-triton); results in $OUT/$TAG.tar.gz
set -u
TAG=${TAG:-gpu_tests}
OUT=${OUT:-/tmp/${TAG}_out}; R=/tmp/$TAG; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-520}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
(
  export CUDA_VISIBLE_DEVICES=0
  step k_main 420 $T tests/test_kernels_gpu.py -k "not triton and not options"
  step others 90 $T tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  ls .whl/*.whl >/dev/null 2>&1 || echo "=== no .whl/ here: the Triton tests will skip (carry .whl)" | tee -a "$R/steps.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1
  PYTHONPATH=/tmp/site:$PYTHONPATH step k_triton 480 $T tests/test_kernels_gpu.py -k "triton or options"
) & B=$!
wait $A $B
step collectives 60 $T tests/test_collectives_gpu.py
finish "$TAG" 12
