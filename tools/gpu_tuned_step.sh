#!/usr/bin/env bash
# Issue 5's gpt-1b step with per-shape autotuned configs, on the lent nvidia-h200-x2:
#   GPU 0: `autotune --quick` on the 8 (M, N, K) shape buckets of gpt-1b's 15 products per
#          layer and head (forward, dX, dW), then the bench's optimised gpt-1b step with our
#          kernel reading that cache, then the same step with XLA's dot;
#   GPU 1 (controls, same time): XLA's step, then our kernel with the shipped default.
#   bash tools/gpu_tuned_step.sh   # results in $OUT/tuned.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/tuned_out}; R=/tmp/tuned; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
# tokens T=8192, d=2048, 4d=8192, vocab 50304: forward T x out x in, dX T x in x out, dW in x out x T
SHAPES=8192x8192x2048,8192x2048x2048,8192x2048x8192,8192x50304x2048,8192x2048x50304,2048x8192x8192,2048x2048x8192,2048x50304x8192
(
  export CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/cache
  step autotune ${T_AT:-240} $PY -m jaxopt_train.kernels.autotune --backend mosaic_gpu --quick \
    --budget-s ${AT_BUDGET:-25} --shapes $SHAPES
  OUT=$R step step_tuned0 ${T_P:-85} $PY tools/probe_gpt1b.py --variants opt --tag _tuned0 --matmul pallas
  OUT=$R step step_xla0 ${T_X:-50} $PY tools/probe_gpt1b.py --variants opt --tag _xla0
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step step_xla1 ${T_X:-50} $PY tools/probe_gpt1b.py --variants opt --tag _xla1
  OUT=$R step step_shipped1 ${T_P:-85} $PY tools/probe_gpt1b.py --variants opt --tag _shipped1 --matmul pallas
) & B=$!
wait $A $B
finish tuned 20
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"  # the probes' JSON rows at the end
