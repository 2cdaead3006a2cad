#!/usr/bin/env bash
# Eleventh session, call 1 (nvidia-h200-x2, <= 9 min).
# Lane 0 (GPU 0): where our Mosaic GPU matmul loses to cuBLAS. In the gpt-1b step it is 3-8%
#   slower on K = 2048 products and ~1.7% faster on K = 8192 (BENCHMARKS.md, fourth session), which
#   points at the per-tile epilogue (both consumers convert and store while the tensor cores wait;
#   with K = 2048 a tile's main loop is ~4x shorter). tools/probe_matmul.py --epilogue times the
#   kernel with its output stores dropped (skip) or without slot waits (nowait) next to XLA.
# Lane 1 (GPU 1, at the same time): the bench's 1-GPU gpt-1b table on the current tree.
# Then both GPUs: the bench's default 2-GPU gpt-1b step with the new gpu-throughput preset
# (1 GiB / 256 MiB combine thresholds), never run itself before.
#   bash tools/gpu_session11.sh   # results in $OUT/summary.txt and $OUT/*.json|md
set -u
OUT=${OUT:-/tmp/s11_out}; R=/tmp/s11; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
SH="8192x8192x2048 16384x8192x2048 8192x6144x2048 8192x8192x8192"
(
  export CUDA_VISIBLE_DEVICES=0
  for mode in ${MODES:-store skip nowait}; do
    step "epi_$mode" 110 $PY tools/probe_matmul.py --variants default,epi128 --no-example \
      --shapes $SH --epilogue $mode --budget-s 80 --grace-s 20 --json "$OUT/epi_$mode.json"
  done
) &
(
  export CUDA_VISIBLE_DEVICES=1
  step gpt1b_1gpu 280 $PY $GPT1B_BENCH --out "$R/gpt1b_1gpu"
) &
wait
step gpt1b_x2 250 $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --out "$R/gpt1b_x2"
finish s11 30
for d in gpt1b_1gpu gpt1b_x2; do cp "$R/$d/train_bench.md" "$OUT/$d.md" 2>/dev/null; cp "$R/$d/train_bench.json" "$OUT/$d.json" 2>/dev/null; done
rm -f "$OUT/s11.tar.gz"
