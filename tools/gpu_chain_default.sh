#!/usr/bin/env bash
# Chained tile pipelines as the shipped Hopper default: the GPU tests that run the default
# config (GPU 0), then `bench train --compare-matmul pallas` (GPU 0) and the trainer with
# --matmul pallas / xla (GPU 1).
#   bash tools/gpu_chain_default.sh   # results in $OUT/chain_default.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/chain_default_out}; R=/tmp/chain_default; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
K='(mosaic_gpu and (forward_matches or fused_epilogue or gradients_match or backward_reads or transpose_b_reads)) or auto_picks'
(
  export CUDA_VISIBLE_DEVICES=0
  step tests ${T_TESTS:-100} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k "$K" -p no:cacheprovider
  step bench_mm ${T_BENCH:-200} $PY $GPT1B_BENCH --compare-matmul pallas --out "$R/bench_mm"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step train_pallas ${T_TP:-150} $PY $GPT1B_TRAIN --matmul pallas --run-dir /tmp/run_pallas
  step train_xla ${T_TX:-80} $PY $GPT1B_TRAIN --matmul xla --run-dir /tmp/run_xla
) & B=$!
wait $A $B
finish chain_default 25
