#!/usr/bin/env bash
# Forty-eighth session, one call (~4-5 min on one H100/H200), carry [".whl"]:
#   1. on jax 0.11.2's CPU (the suite's -O0), beside the GPU steps: the tests behind call 1's
#      three failures (ZeRO's check now in f32; the two collectives tests that segfaulted XLA
#      while compiling), then tools/probe_collectives_segv.py (each reduction alone, -O0 or not);
#   2. on the GPU: `jaxopt-train autotune --quick` of mosaic_gpu on small and large shapes, now
#      timing XLA's dot beside each winner (the ratio printed), and what matmul(backend="auto")
#      then runs on each; the GPU autotune tests.
#   bash tools/gpu_session48.sh
set -u
OUT=${OUT:-/tmp/s48_out}; R=/tmp/s48; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"
(
  export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0
  STEP_TAIL=8 step cpu_tests 300 $PY -m pytest -q -rfE -p no:cacheprovider -n 4 \
    tests/test_zero.py tests/test_collectives_integration.py tests/test_autotune_xla.py
  PROBE_WORKERS=4 STEP_TAIL=0 step probe 300 $PY tools/probe_collectives_segv.py
) &
export CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/cache
SHAPES=${SHAPES:-1024x1024x1024,1000x777x513,3000x5000x1000,8192x8192x8192}
STEP_TAIL=20 step autotune 240 $PY -m jaxopt_train.kernels.autotune --backend mosaic_gpu --quick \
  --budget-s "${BUDGET_S:-25}" --shapes "$SHAPES"
STEP_TAIL=8 step auto_pick 60 $PY -c "
import jax, jax.numpy as jnp
from jaxopt_train.kernels import matmul
for s in '$SHAPES'.split(','):
    m, n, k = map(int, s.split('x'))
    a, b = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    kernel = 'pallas_call' in str(jax.make_jaxpr(lambda a, b: matmul(a, b))(a, b))
    print(s, 'auto runs', 'the mosaic_gpu kernel' if kernel else \"XLA's dot\")
"
cp "$R/cache/matmul_autotune.json" "$R/" 2>/dev/null
STEP_TAIL=4 step gpu_tests 150 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/test_kernels_gpu.py -k "autotune or auto_picks"
wait
finish s48 60
