#!/usr/bin/env bash
# Thirty-second session, call E (~3 min on nvidia-h200): the kernel audit's fixes on the GPU.
# Empty operands (now answered by jnp before any backend), the out_dtype errors, a vmapped b's
# gradient on the xla backend (the CPU-only f32 widening must leave the GPU path as it was),
# and the GPU kernel tests of automatic backend choice and second derivatives.
#   bash tools/gpu_session32e.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s32e_out}; R=/tmp/s32e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-250}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=5 step t_kern 100 $T tests/test_kernels.py -k "empty or bad_inputs or vmapped_b"
STEP_TAIL=5 step t_kern_gpu 130 $T tests/test_kernels_gpu.py -k "auto_picks or second_derivatives"
finish s32e 25
