#!/usr/bin/env bash
# Single-GPU lanes on the 2-GPU machine, one per GPU, in parallel:
#   lane 0: the bench's optimised gpt-1b step (tools/probe_gpt1b.py variant "opt") under XLA
#           flag variants (cuBLASLt epilogues, cuDNN LayerNorm, cuDNN GEMM fusions), one process
#           per variant, each lane re-running the baseline flags as its control;
#   then the trainer's gpt-1b step with --matmul xla (GPU 0) and --matmul pallas (GPU 1).
#   bash tools/gpu_lanes.sh     # results in $OUT/lanes.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/lanes_out}; R=/tmp/lanes; mkdir -p "$R" "$OUT"
source "$(dirname "$0")/gpu_common.sh"
V=${VARIANT:-opt}
probe() {  # probe TAG XLA_EXTRA
  OUT=$R step "gpt1b$1" ${T_P:-90} $PY tools/probe_gpt1b.py --variants $V --tag "$1" ${2:+"--xla-extra=$2"}
}
lane() {  # lane GPU MATMUL TRAIN_TIMEOUT "TAG=XLA_FLAGS"...: the probes, then the trainer
  export CUDA_VISIBLE_DEVICES=$1; local matmul=$2 limit=$3 spec; shift 3
  for spec in "$@"; do probe "${spec%%=*}" "${spec#*=}"; done
  step train_$matmul $limit $PY $GPT1B_TRAIN --matmul $matmul --run-dir /tmp/run_$matmul
}
lane 0 xla ${T_T:-200} "_base0=" "_cublaslt=--xla_gpu_enable_cublaslt=true" \
  "_cudnnln=--xla_gpu_enable_cudnn_layer_norm=true" & A=$!
lane 1 pallas ${T_T2:-260} "_base1=" "_cudnngemm=--xla_gpu_cudnn_gemm_fusion_level=2" \
  "_all=--xla_gpu_enable_cublaslt=true --xla_gpu_enable_cudnn_layer_norm=true" & B=$!
wait $A $B
finish lanes 14
