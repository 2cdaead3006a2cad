#!/usr/bin/env bash
# One 2-GPU call: gpt-1b's optimised step with XLA's dot, our Mosaic GPU kernel and our Triton
# kernel in one process (GPU 0: bench train --compare-matmul pallas,triton), and the trainer with
# --matmul triton (GPU 1). Needs jax-triton on PYTHONPATH.
#   bash tools/gpu_matmul_triton.sh   # results in $OUT/mmt.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mmt_out}; R=/tmp/mmt; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
CUDA_VISIBLE_DEVICES=0 step bench_mm ${T_B:-300} $PY $GPT1B_BENCH --compare-matmul pallas,triton --out "$R/gpt1b_mm" & A=$!
CUDA_VISIBLE_DEVICES=1 step train_triton ${T_T:-240} $PY $GPT1B_TRAIN --matmul triton --run-dir /tmp/run_triton & B=$!
wait $A $B
finish mmt
