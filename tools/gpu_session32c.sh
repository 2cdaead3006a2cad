#!/usr/bin/env bash
# Thirty-second session, call C (~4 min on nvidia-h200): was call B's XLA 1024^3 row (13.6
# TFLOP/s, a third of earlier sessions') the cold operands or the first shape of the run?
# The same four small shapes in the reverse order, 3 s of warm-up, twice; then
# tests/test_bench_train.py without its 2-device quick runs (call B's step limit was too short).
#   bash tools/gpu_session32c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s32c_out}; R=/tmp/s32c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
for i in 1 2; do
  STEP_TAIL=9 step mm_rev$i 100 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --no-fused --no-layer \
    --warmup-s 3 --shapes 3000x5000x1000,1000x777x513,2048x512x2048,1024x1024x1024 --json $R/mm_rev$i.json
done
STEP_TAIL=6 step t_bench_train 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_bench_train.py -k "not quick"
finish s32c 25
