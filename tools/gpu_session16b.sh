#!/usr/bin/env bash
# Sixteenth session, second device call (one nvidia-h200, ~8 min).
# 1. The Mosaic GPU wrapper now pads only what its TMA copies need (`_tma_extent`) and
#    lets TMA cover partial tiles: the kernel GPU tests of odd shapes and transposes on
#    it, plus the 32 tests call 1 had no time for (tools/gpu16b_tests.txt, 107 ids).
# 2. The new small-grid default (`configs._fill_the_sms`): the shipped tile against the
#    halved one on shapes the rule was not fitted on (autotune --candidates, no cache).
# 3. bench matmul (no cache: the library's defaults) on the odd and small shapes.
# 4. The other modules' GPU tests (not collectives: one GPU).
#   bash tools/gpu_session16b.sh   # carry [".whl"]; $OUT/summary.txt, $OUT/mm.json
set -u
OUT=${OUT:-/tmp/s16b_out}; R=/tmp/s16b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 || echo "=== no .whl/: the Triton tests will skip" | tee -a "$R/steps.log"
STEP_TAIL=8 PYTHONPATH=/tmp/site:$PYTHONPATH step kernels 260 $T $(cat tools/gpu16b_tests.txt)
CANDIDATES='[{"block_m":128,"block_n":128,"block_k":64,"num_stages":4,"group_m":16,"grid_minor":"n","chain_tiles":true},
 {"block_m":64,"block_n":128,"block_k":64,"num_stages":4,"group_m":8,"chain_tiles":true}]'
STEP_TAIL=12 JAXOPT_TRAIN_CACHE_DIR=$R/cache step halved 80 $PY -m jaxopt_train.kernels.autotune \
  --backend mosaic_gpu --budget-s 30 --candidates "$CANDIDATES" \
  --shapes 1024x2048x4096,512x4096x2048,2048x1024x2048,1024x1024x4096,1024x2176x4096,768x768x3072
STEP_TAIL=14 JAXOPT_TRAIN_CACHE_DIR=$R/nocache step mm 130 $PY -m jaxopt_train.bench.matmul \
  --backends mosaic_gpu --warmup-s 3 --no-fused --no-layer --json "$OUT/mm.json" \
  --shapes 8192x8192x8192,3000x5000x1000,3000x4096x1024,1000x777x513,2048x512x2048,1024x1024x1024,1024x2048x4096
step others 90 $T tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
finish s16b 25
