#!/usr/bin/env bash
# Thirty-second session, call B (~6 min on nvidia-h200): the tests call A could not run
# (the compile-cache fixture asked jax 0.11 for an option it lacks; three checks assumed a
# CPU backend), the trainer test files whole on one GPU, and bench matmul's small shapes
# with the new rotation (a 1024^3 set is 4 MiB: 32 sets now, 4 before, so L2 no longer holds them).
#   bash tools/gpu_session32b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s32b_out}; R=/tmp/s32b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=6 step t_changed 120 $T tests/test_docstring_examples.py tests/test_train_inputs.py tests/test_train_cli.py
STEP_TAIL=4 step t_bench_train 80 $T tests/test_bench_train.py -k "not quick"
STEP_TAIL=6 step t_trainer 200 $T tests/test_train.py tests/test_trainer_models.py
STEP_TAIL=16 step mm_small 170 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --no-fused --no-layer \
  --shapes 1024x1024x1024,2048x512x2048,1000x777x513,3000x5000x1000 --json $R/mm_small.json
finish s32b 25
