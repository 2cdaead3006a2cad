#!/usr/bin/env bash
# Prepared in the forty-second session, when every start of a machine was refused; run in the
# forty-fourth (one H100: BENCHMARKS.md). One call (~9 min on one H100/H200), in order of need:
#   1. the GPU tests of the Flax-layer kernel file (session 40's shard_map test, fixed in session
#      41 and not yet run on a GPU) and of autotune (its memory check changed in session 41);
#   2. bench matmul: the four large shapes and the fused bias+gelu epilogue, Mosaic GPU and Triton
#      against XLA's dot in the same process, interleaved shape by shape;
#   3. bench train gpt-1b: baseline, optimised and the two plain Flax + optax yardsticks, 15 s of
#      warm-up per config (the power-capped steady state), if time is left before DEADLINE.
#   bash tools/gpu_session42.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s42_out}; R=/tmp/s42; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu,driver_version --format=csv > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"; $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)" | tee -a "$R/steps.log"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
STEP_TAIL=6 step tests 150 $T tests/test_kernels_flax_layers.py tests/test_kernels_gpu.py -k "flax_layers or autotune"
STEP_TAIL=30 step mm 200 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --warmup-s 4 \
  --no-layer --shapes 8192x8192x8192,4096x4096x4096,16384x8192x2048,16384x2048x8192 --json "$R/mm.json"
STEP_TAIL=12 step gpt1b 330 $PY $GPT1B_BENCH --warmup-s 15 --no-scaling --compare-plain --out "$R/gpt1b"
cp "$R"/gpt1b/*.png "$OUT"/ 2>/dev/null
finish s42 40
