#!/usr/bin/env bash
# One device call of diagnostics on the 2-GPU machine ($OUT/probe.tar.gz, $OUT/summary.txt):
#   lane GPU0: tools/probe_gpt1b.py (step variants, kernel-time profile, XLA flag A/B)
#   lane GPU1: tools/probe_matmul.py (Mosaic GPU variants vs XLA and JAX's example)
#   then both GPUs: tools/probe_dp.py (data-parallel gpt-1b and ring variants)
set -u
OUT=${OUT:-/tmp/probe_out}; R=/tmp/probe; mkdir -p "$R" "$OUT"  # $OUT gets 2 files only
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
t0=$(date +%s)
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2; local s=$(date +%s)
  echo "=== [$name] start +$((s - t0))s" | tee -a "$R/steps.log"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "=== [$name] rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$R/steps.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv > "$R/nvidia-smi.txt" 2>&1
lane_a() {
  export CUDA_VISIBLE_DEVICES=0 OUT=$R
  step gpt1b ${T_A1:-240} $PY tools/probe_gpt1b.py --profile ${GPT_VARIANTS:+--variants $GPT_VARIANTS}
  step gpt1b_noflags 60 $PY tools/probe_gpt1b.py --variants v0 --xla-preset none --tag _noflags
  step gpt1b_notriton 60 $PY tools/probe_gpt1b.py --variants v0 --tag _notriton \
    --xla-extra "--xla_gpu_enable_triton_gemm=false"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=1 OUT=$R
  [ -f tools/probe_matmul.py ] && step matmul ${T_B1:-240} $PY tools/probe_matmul.py
  step kernel_gpu_tests 150 $PY -m pytest -q -m gpu tests/test_kernels_gpu.py
}
lane_a & A=$!; lane_b & B=$!; wait $A $B
[ -f tools/probe_dp.py ] && OUT=$R step dp ${T_DP:-210} $PY tools/probe_dp.py
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
for f in "$R"/*.log; do echo "----- $f"; tail -n 60 "$f"; done > "$OUT/summary.txt"
tar czf "$OUT/probe.tar.gz" --exclude='trace_*' -C /tmp probe
