#!/usr/bin/env bash
# Tenth session, call 6 (nvidia-h200-x2, <= 9 min): issue 6's 2-GPU scaling under smaller XLA
# combine thresholds. The bench's ZeRO-1 step all-gathers the bf16 weights per leaf at the step's
# start and reduce-scatters the gradients per leaf in the backward; the gpu-throughput preset lets
# XLA combine all-gathers up to 256 MiB and reduce-scatters up to 64 MiB, so the first layer can
# wait for a large combined gather and the last reduce-scatter is large. Control first, then the
# same with all-gathers combined up to 32 MiB and reduce-scatters up to 16 MiB.
#   bash tools/gpu_session10e.sh   # results in $OUT/s10e.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s10e_out}; R=/tmp/s10e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
X2="-m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 --warmup 5 --bursts 3 \
  --trace-steps 5 --steps-per-dispatch 1"
step dp_default 230 $PY $X2 --out "$R/gpt1b_x2"
step dp_small_combine 230 $PY $X2 \
  "--xla-extra=--xla_gpu_all_gather_combine_threshold_bytes=33554432 --xla_gpu_reduce_scatter_combine_threshold_bytes=16777216" \
  --out "$R/gpt1b_x2_small_combine"
finish s10e 25
for d in gpt1b_x2 gpt1b_x2_small_combine; do cp "$R/$d/train_bench.md" "$OUT/$d.md" 2>/dev/null; cp "$R/$d/train_bench.json" "$OUT/$d.json" 2>/dev/null; done
