#!/usr/bin/env bash
# Thirteenth session, call 3 (nvidia-h200-x2, ~5 min): issue 5's isolated shapes at the power-capped
# steady state. `bench matmul` with our Mosaic GPU kernel against XLA's dot, 8 s warm-up before each
# (backend, shape) instead of 1 s, once per GPU at the same time (two independent runs); nvidia-smi
# samples both GPUs every 500 ms (killed by PID: never a bare `wait` on it).
#   [GPUS=0] bash tools/gpu_session13.sh   # GPUS=0 on a one-GPU machine; results in $OUT/mm_g{0,1}.json, $OUT/smi.csv, $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s13_out}; R=/tmp/s13; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=timestamp,index,temperature.gpu,power.draw,clocks.sm,clocks_event_reasons.active \
  --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 & SMI=$!
lane() {  # lane GPU: the bench on that GPU
  CUDA_VISIBLE_DEVICES=$1 step "mm_g$1" 400 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
    --warmup-s 8 --no-fused --json "$OUT/mm_g$1.json"
}
PIDS=()
for g in ${GPUS:-0 1}; do lane "$g" & PIDS+=($!); done
wait "${PIDS[@]}"
kill $SMI
finish s13 40
