#!/usr/bin/env bash
# Ninth session, call 2 (nvidia-h200-x2, <= 9.5 min).
#   both GPUs: gpt-1b's 2-GPU bench train (ZeRO-1 default) as the control, then the same with
#              NCCL capped at 8 channels (--xla_gpu_nccl_collective_max_nchannels=8: each NCCL
#              kernel takes fewer SMs from the GEMMs it overlaps; the third session tried this
#              only with the psum all-reduce after the backward, where it lost);
#   GPU 0, 1:  gpt-1b's 1-GPU bench train (baseline vs optimised), one run per GPU at once, on
#              the code with the eighth session's NaN guards.
#   bash tools/gpu_session9b.sh   # results in $OUT/s9b.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s9b_out}; R=/tmp/s9b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
X2="-m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 --warmup 5 --bursts 3 \
  --trace-steps 5 --steps-per-dispatch 1"
step dp_default 200 $PY $X2 --out "$R/gpt1b_x2"
step dp_nch8 200 $PY $X2 --xla-extra=--xla_gpu_nccl_collective_max_nchannels=8 --out "$R/gpt1b_x2_nch8"
for g in 0 1; do
  ( export CUDA_VISIBLE_DEVICES=$g; step gpt1b_gpu$g 150 $PY $GPT1B_BENCH --no-scaling --out "$R/gpt1b_gpu$g" ) &
done
wait
finish s9b 25
