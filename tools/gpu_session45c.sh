#!/usr/bin/env bash
# The GPU tests of every module but the kernel file (session 41's "others": 2 failures then,
# the shard_map test fixed since), then the Triton kernel tests (~200 s on an H200), on the tree
# with the kernel-output cast of 0bb0d5d. ~7 min.
#   bash tools/gpu_session45c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s45c_out}; R=/tmp/s45c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-450}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
T="$PY -m pytest -q -rfEs -m gpu -p no:cacheprovider"
STEP_TAIL=12 step others 200 $T tests --ignore=tests/test_kernels_gpu.py
STEP_TAIL=6 step k_triton 260 $T tests/test_kernels_gpu.py -k triton
finish s45c 30
