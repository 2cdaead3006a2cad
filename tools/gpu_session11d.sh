#!/usr/bin/env bash
# Eleventh session, call 4 (nvidia-h200-x2, ~9 min): every GPU-marked test on the final tree
# (the shared-ring ping-pong kernel and the num_sms() rename landed since the last full run).
#   GPU 0: kernel tests except Triton and the option sweeps, then the other modules' GPU tests;
#   GPU 1: Triton and option-sweep kernel tests (jax-triton from .whl on PYTHONPATH);
#   both:  tests/test_collectives_gpu.py (needs the pair).
#   bash tools/gpu_session11d.sh   # with carry [".whl"] (jax-triton); results in $OUT/s11d.tar.gz
set -u
OUT=${OUT:-/tmp/s11d_out}; R=/tmp/s11d; mkdir -p "$R" "$OUT"
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
finish s11d 12
