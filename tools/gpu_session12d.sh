#!/usr/bin/env bash
# Twelfth session, call 4 (nvidia-h200-x2, <= 6 min): call 3 again without its nvidia-smi
# (its `wait` hung on it). Both GPUs: the optimised gpt-1b step with XLA's dot and with our kernel,
# 15 s warm-up each, one process each, in opposite orders; then the default 2-GPU table with the
# same warm-up (its 1-GPU rerun in the same process).
# In call 4 the pallas probes ran past 75 s (compile ~40 s + 15 s warm-up): to repeat the pairs,
#   T_P=130 DEADLINE=450 bash tools/gpu_session12d.sh
#   bash tools/gpu_session12d.sh   # results in $OUT/summary.txt, $OUT/rows.txt, $OUT/*.json
set -u
OUT=${OUT:-/tmp/s12d_out}; R=/tmp/s12d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
lane() {  # lane GPU TAG...: one probe per tag, "*pallas" tags with our kernel
  export CUDA_VISIBLE_DEVICES=$1; shift
  local tag mm
  for tag in "$@"; do
    mm=(); if [[ $tag == *pallas ]]; then mm=(--matmul pallas); fi
    OUT=$R step "probe_$tag" ${T_P:-75} $PY tools/probe_gpt1b.py --variants opt --warmup-s 15 --tag "_$tag" "${mm[@]}"
  done
}
lane 0 g0a_xla g0b_pallas & A=$!
lane 1 g1a_pallas g1b_xla & B=$!
wait $A $B
STEP_TAIL=14 step bench2 230 $PY $GPT1B_BENCH --global-batch 16 --warmup-s 15 --json "$OUT/gpt1b_2gpu.json"
finish s12d 14 --exclude=*.trace.json.gz --exclude=hlo_*
grep -h '^\[probe\] {' "$R"/*.log > "$OUT/rows.txt"
