#!/usr/bin/env bash
# Eleventh session, call 2 (nvidia-h200-x2, <= 9 min): the ping-pong schedule with one shared ring.
# GPU 0: its GPU tests (every test with a ping-pong config), then tools/probe_matmul.py on
#   gpt-1b-like K = 2048 shapes and the issue's large shapes: shipped default vs ping-pong at 4
#   and 6 stages (and 6 with one wgmma in flight), XLA in the same process.
# GPU 1: the bench's optimised gpt-1b step (tools/probe_gpt1b.py --variants opt) with XLA's dot,
#   our shipped kernel config, and ping-pong with 6 stages for every product.
#   bash tools/gpu_session11b.sh   # results in $OUT/summary.txt and $OUT/*.json
set -u
OUT=${OUT:-/tmp/s11b_out}; R=/tmp/s11b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step tests_pingpong 200 $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k pingpong -p no:cacheprovider
  step probe_pp 200 $PY tools/probe_matmul.py --variants default,pp6,pp4,pp6_inflight --no-example \
    --shapes 8192x8192x2048 8192x6144x2048 8192x2048x2048 8192x50304x2048 8192x8192x8192 \
      4096x4096x4096 16384x8192x2048 16384x2048x8192 --budget-s 150 --json "$OUT/probe_pp.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for spec in xla=xla pallas= pp6='{"schedule":"pingpong","num_stages":6}'; do
    gpt1b_probe "${spec%%=*}" "${spec#*=}"
  done
) &
wait
finish s11b 20
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
cp "$R"/gpt1b_probe*.json "$OUT/" 2>/dev/null
rm -f "$OUT/s11b.tar.gz"
