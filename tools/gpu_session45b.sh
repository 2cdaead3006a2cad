#!/usr/bin/env bash
# The shard_map kernel GPU test after its kernel check was fixed (it looked for "pallas_call"
# in the printed jaxpr; Mosaic GPU's plgpu.kernel traces to a core_map), then the kernel
# gradient tests (120 s were too few for them in tools/gpu_session45.sh). ~6 min.
#   bash tools/gpu_session45b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s45b_out}; R=/tmp/s45b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=8 step shard_map 80 $T tests/test_kernels_flax_layers.py
STEP_TAIL=8 step grads 320 $T tests/test_kernels_gpu.py -k grad
finish s45b 20
