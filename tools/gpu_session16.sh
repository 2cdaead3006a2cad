#!/usr/bin/env bash
# Prepared in the fifteenth session for the next device call (~9 min; nvidia-h200-x2 runs the
# lanes side by side, GPUS=0 on nvidia-h200 one after the other as far as DEADLINE allows).
# Lane A (GPU 0), issue 5's small and odd shapes, which lose to XLA with the shipped
# 256x128-per-CTA tile (thirteenth session: 2048x512x2048 0.896x, 1000x777x513 0.679x,
# 3000x5000x1000 0.906x): autotune them over smaller tiles (`autotune --candidates`, new),
# then `bench matmul --shapes` (new) reads the cached winners, 8192^3 as the control.
# Lane B (GPU 1): every GPU kernel test on the new fused-MLP backward and fuse default
# (the fifteenth session ran only the kept-Z ones), then the other modules' GPU tests.
# Last, on two GPUs only, the collective tests.
#   bash tools/gpu_session16.sh   # carry [".whl"]; results in $OUT/summary.txt, $OUT/mm.json,
#                                 # $OUT/autotune_cache.json
set -u
OUT=${OUT:-/tmp/s16_out}; R=/tmp/s16; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
GPUS=${GPUS:-0 1}
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
# The shipped default first (the control inside the sweep), then 128-row CTAs (64 per
# consumer) and narrower N tiles, each chained as the default is.
CANDIDATES='[{"block_m":128,"block_n":128,"block_k":64,"num_stages":4,"group_m":16,"grid_minor":"n","chain_tiles":true},
 {"block_m":64,"block_n":128,"block_k":64,"num_stages":4,"group_m":8,"chain_tiles":true},
 {"block_m":64,"block_n":128,"block_k":64,"num_stages":4,"group_m":8,"wg_split":"n","chain_tiles":true},
 {"block_m":128,"block_n":64,"block_k":64,"num_stages":4,"group_m":8,"chain_tiles":true},
 {"block_m":64,"block_n":64,"block_k":64,"num_stages":4,"group_m":8,"chain_tiles":true},
 {"block_m":64,"block_n":128,"block_k":128,"num_stages":3,"group_m":8,"chain_tiles":true}]'
lane_a() {
  export CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/cache
  step tune_small 300 $PY -m jaxopt_train.kernels.autotune --backend mosaic_gpu \
    --shapes 1024x1024x1024,2048x512x2048,1000x777x513,3000x5000x1000 --budget-s 60 \
    --candidates "$CANDIDATES"
  cp "$R"/cache/*.json "$OUT/autotune_cache.json" 2>/dev/null
  STEP_TAIL=30 step mm 240 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu --warmup-s 4 \
    --shapes 8192x8192x8192,1024x1024x1024,2048x512x2048,1000x777x513,3000x5000x1000 \
    --no-fused --no-layer --json "$OUT/mm.json"
}
lane_b() {  # lane_b GPU
  export CUDA_VISIBLE_DEVICES=$1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1 || echo "=== no .whl/: the Triton tests will skip" | tee -a "$R/steps.log"
  PYTHONPATH=/tmp/site:$PYTHONPATH step k_all 480 $T tests/test_kernels_gpu.py
  step others 90 $T tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
}
if [ "$GPUS" = "0" ]; then
  lane_a; lane_b 0  # one GPU: what time is left after the sweep (DEADLINE)
else
  lane_a & A=$!; lane_b 1 & B=$!; wait $A $B
  step collectives 60 $T tests/test_collectives_gpu.py
fi
finish s16 25
