#!/usr/bin/env bash
# The sixth session's measuring call on the lent nvidia-h200-x2:
#   1. both GPUs: issue 4's data-parallel GPT step on the standard gpt-124m (12 layers; the
#      earlier rows cut it to 2 layers), psum / ring and per-leaf ZeRO-1;
#   2. GPU 0: `autotune --quick` (now with the chained kernel's orders and 2-CTA clusters) on the
#      four large shapes, then `bench matmul` with that cache (issue 5's 8192^3 / geomean rows);
#      GPU 1 at the same time: the gpt-1b step with our kernel under $LANE1 (gpu_matmul_configs.sh).
#   SKIP_DP=1 leaves out step 1.
#   bash tools/gpu_session6.sh   # results in $OUT/s6.tar.gz, $OUT/mmcfg.tar.gz, $OUT/summary*.txt
set -u
OUT=${OUT:-/tmp/s6_out}; R=/tmp/s6; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
SHAPES=8192x8192x8192,16384x8192x2048,16384x2048x8192,4096x4096x4096
[ -n "${SKIP_DP:-}" ] || step dp_gpt124m ${T_DP:-150} $PY -m jaxopt_train.bench.collectives --sizes 1M --dtypes f32 --chunks 1 \
  --methods ring --gpt --gpt-grad-dtype compute --gpt-zero1 --gpt-config gpt-124m \
  --gpt-overrides dtype=bfloat16 --gpt-batch 8 --gpt-methods psum,ring --gpt-iters 10 \
  --json "$R/dp_gpt124m.json"
(
  export CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/cache
  step autotune ${T_AT:-200} $PY -m jaxopt_train.kernels.autotune --backend mosaic_gpu --quick \
    --budget-s ${AT_BUDGET:-45} --shapes $SHAPES
  step bench_matmul ${T_MM:-200} $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
    --calls 10 --bursts 3 --warmup-s 0.3 --json "$R/matmul.json"
) & A=$!
if [ -n "${LANE1:-}" ]; then
  LANE0= DEADLINE=$(( DEADLINE - $(date +%s) + t0 )) bash "$(dirname "$0")/gpu_matmul_configs.sh" & B=$!
  wait $A $B
  cp "$OUT/summary.txt" "$OUT/summary_mmcfg.txt"
else
  wait $A
fi
finish s6 40
