#!/usr/bin/env bash
# Twelfth session, call 1 (nvidia-h200-x2, <= 9.5 min). Two single-GPU lanes:
# GPU 0: the bench's optimised gpt-1b step with XLA's dot, profiled (every kernel's time, for a
#   diff against GPU 1's trace), then the bench's default step (optcopy) under XLA fusion and
#   autotuning flags that no earlier session tried, one process per flag set, with controls.
# GPU 1: the same step with our kernel (--matmul pallas), profiled, then more flag sets.
#   bash tools/gpu_session12.sh   # results in $OUT/summary.txt, $OUT/*.json, $OUT/s12.tar.gz
set -u
OUT=${OUT:-/tmp/s12_out}; R=/tmp/s12; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
flagrun() {  # flagrun TAG "XLA flags": the bench's default step (optcopy) under extra flags
  OUT=$R step "flags$1" ${T_F:-100} $PY tools/probe_gpt1b.py --variants optcopy --tag "$1" ${2:+"--xla-extra=$2"}
}
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$R step prof_xla 120 $PY tools/probe_gpt1b.py --variants opt --profile --tag _prof_xla
  flagrun _base0 ""
  flagrun _twarp "--xla_gpu_experimental_enable_triton_warp_specialization=true"
  flagrun _blocklevel "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true"
  flagrun _gemmany "--xla_gpu_triton_gemm_any=true"
  flagrun _base0b ""
  T_F=200 flagrun _exhaustive "--xla_gpu_exhaustive_tiling_search=true"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step prof_pallas 170 $PY tools/probe_gpt1b.py --variants opt --profile --tag _prof_pallas --matmul pallas
  flagrun _base1 ""
  flagrun _softmax "--xla_gpu_enable_softmax_fusion=true"
  flagrun _heroless "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"
  flagrun _alltriton "--xla_gpu_experimental_all_fusions_with_triton=true"
  flagrun _base1b ""
) &
wait
finish s12 12 --exclude=*.trace.json.gz --exclude=*.xplane.pb
grep -h '^\[probe\] {' "$R"/*.log > "$OUT/rows.txt"
cp "$R"/gpt1b_probe_prof_*.json "$OUT/" 2>/dev/null
tail -n 40 "$OUT/summary.txt"
