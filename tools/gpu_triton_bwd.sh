#!/usr/bin/env bash
# One 2-GPU call after the Triton kernel learnt strided (transposed) operands: its GPU tests
# (GPU 1) and gpt-1b's optimised step with XLA's dot vs the Triton kernel (GPU 0).
#   bash tools/gpu_triton_bwd.sh   # results in $OUT/tb.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/tb_out}; R=/tmp/tb; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-260}
source "$(dirname "$0")/gpu_common.sh"
CUDA_VISIBLE_DEVICES=0 step bench_mm ${T_B:-250} $PY $GPT1B_BENCH --compare-matmul triton --out "$R/gpt1b_mm" & A=$!
CUDA_VISIBLE_DEVICES=1 step triton_tests ${T_K:-200} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py \
  -k "triton or transpose" -p no:cacheprovider & B=$!
wait $A $B
finish tb
