#!/usr/bin/env bash
# One device call of diagnostics on the 2-GPU machine ($OUT/probe.tar.gz, $OUT/summary.txt):
#   lane GPU0: tools/probe_gpt1b.py (step variants, kernel-time profile, XLA flag A/B)
#   lane GPU1: tools/probe_matmul.py (Mosaic GPU variants vs XLA and JAX's example)
#   then both GPUs: tools/probe_dp.py (data-parallel gpt-1b and ring variants)
set -u
OUT=${OUT:-/tmp/probe_out}; R=/tmp/probe; mkdir -p "$R" "$OUT"  # $OUT gets 2 files only
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv > "$R/nvidia-smi.txt" 2>&1
lane_a() {
  export CUDA_VISIBLE_DEVICES=0 OUT=$R
  step gpt1b_notriton ${T_A1:-200} $PY tools/probe_gpt1b.py --profile --tag _notriton \
    --variants ${GPT_VARIANTS:-v0,st16,dots16,pure} --xla-extra=--xla_gpu_enable_triton_gemm=false
  step gpt1b ${T_A2:-60} $PY tools/probe_gpt1b.py --profile --variants v0
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=1 OUT=$R
  [ -n "${MATMUL:-}" ] && step matmul ${T_B1:-240} $PY tools/probe_matmul.py
  step kernel_gpu_tests ${T_B2:-250} $PY -m pytest -q -rf -m gpu tests/test_kernels_gpu.py
}
# PART=1: the two single-GPU lanes; PART=2: the 2-GPU probe (a second call keeps each
# call well inside the device tool's 10-minute limit).
case ${PART:-1} in *1*) lane_a & A=$!; lane_b & B=$!; wait $A $B;; esac
case ${PART:-1} in *2*) OUT=$R step dp ${T_DP:-230} $PY tools/probe_dp.py ${DP_ARGS:-};; esac
finish probe 60 --exclude='trace_*'
