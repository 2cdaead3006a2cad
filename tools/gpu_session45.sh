#!/usr/bin/env bash
# One call (~9 min on one H100/H200):
#   1. the shard_map kernel test after 0bb0d5d (GPU kernel outputs vary as their operands),
#      which failed on the H100 in the forty-fourth session, and the kernel gradient tests as a
#      check that the cast changed nothing outside shard_map;
#   2. bench train gpt-1b with the pool preallocated as one region (XLA's default) at 95% of the
#      GPU, the advice of the baseline hint since 946918a: session 44's f32 baseline ran out of
#      memory on an H100 in a pool grown on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false).
#   bash tools/gpu_session45.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s45_out}; R=/tmp/s45; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv | tee "$R/gpu.txt"
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)" | tee -a "$R/steps.log"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=8 step shard_map 80 $T tests/test_kernels_flax_layers.py
STEP_TAIL=8 step grads 120 $T tests/test_kernels_gpu.py -k grad
XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_CLIENT_MEM_FRACTION=0.95 \
  STEP_TAIL=14 step gpt1b 330 $PY $GPT1B_BENCH --warmup-s 15 --no-scaling --compare-plain --out "$R/gpt1b"
cp "$R"/gpt1b/*.png "$OUT"/ 2>/dev/null
finish s45 20
