#!/usr/bin/env bash
# Twelfth session, call 3 (nvidia-h200-x2, <= 9.5 min): the gpt-1b tables at the power-capped
# steady state (--warmup-s 15: each config runs 15 s before it is timed).
# GPU 0: `bench train --compare-matmul pallas` on one GPU (baseline, optimised, our kernel).
# GPU 1: the optimised step with our kernel, then XLA's, then ours again (one process each,
#   15 s warm-up each), with nvidia-smi sampling SM clock and power every 200 ms.
# Both GPUs: the default 2-GPU table with the same warm-up (its 1-GPU rerun in the same process).
#   bash tools/gpu_session12c.sh   # results in $OUT/summary.txt, $OUT/*.md|json
set -u
OUT=${OUT:-/tmp/s12c_out}; R=/tmp/s12c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-565}
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu \
  --format=csv,noheader -lms 200 > "$R/smi.csv" 2>&1 & SMI=$!
(
  export CUDA_VISIBLE_DEVICES=0
  step bench1_mm 260 $PY $GPT1B_BENCH --warmup-s 15 --no-scaling --compare-matmul pallas \
    --json "$OUT/gpt1b_1gpu_mm.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for tag in a_pallas b_xla c_pallas; do
    mm=(); if [[ $tag == *pallas ]]; then mm=(--matmul pallas); fi
    OUT=$R step "probe_$tag" 90 $PY tools/probe_gpt1b.py --variants opt --warmup-s 15 --tag "_$tag" "${mm[@]}"
  done
) &
wait  # BUG in call 3: this also waits for nvidia-smi, so the call ran into its 600 s limit (see 12d)
STEP_TAIL=14 step bench2 300 $PY $GPT1B_BENCH --global-batch 16 --warmup-s 15 --json "$OUT/gpt1b_2gpu.json"
kill $SMI
finish s12c 14 --exclude=*.trace.json.gz --exclude=hlo_*
grep -h '^\[probe\] {' "$R"/*.log > "$OUT/rows.txt"
cp "$R/smi.csv" "$OUT/"
