#!/usr/bin/env bash
# The shard_map kernel test after 0bb0d5d (GPU kernel outputs vary as their operands), which
# failed on the H100 in the forty-fourth session's first call, and the kernel gradient tests
# as a check that the cast changed nothing outside shard_map. ~4 min on one H100 (the gradient
# tests took 194 s there: the 120 s they had first were too few). It ran in the forty-fifth
# session, on 882b3b5, as tools/gpu_session45b.sh, since folded in here: 2 + 10 passed.
#   bash tools/gpu_session44.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s44_out}; R=/tmp/s44; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=8 step shard_map 80 $T tests/test_kernels_flax_layers.py
STEP_TAIL=8 step grads 320 $T tests/test_kernels_gpu.py -k grad
finish s44 20
