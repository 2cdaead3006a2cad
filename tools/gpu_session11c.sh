#!/usr/bin/env bash
# Eleventh session, call 3 (nvidia-h200-x2, <= 9 min): MatmulConfig(epilogue_store="direct"), the
# consumers store their finished tiles from registers to global memory (no SMEM slots, fences or
# TMA waits while the tensor cores idle; call 1 timed that epilogue at 1-8% of the kernel on K = 2048).
# GPU 0: the GPU tests of every "direct" config, then tools/probe_matmul.py on gpt-1b-like K = 2048
#   shapes and the issue's large shapes (shipped default vs direct stores), XLA in the same process.
# GPU 1: the bench's optimised gpt-1b step (tools/probe_gpt1b.py --variants opt) with XLA's dot,
#   our shipped config, and the shipped config with direct stores, for every product.
# Ran at commit 11ef469 (as STEP_EXTRA='directnab={"epilogue_store":"direct","no_auto_barriers":true}'
# bash tools/gpu_session11c.sh). Direct stores lost everywhere (BENCHMARKS.md), so the option was
# removed again; this script is the record of that call and needs that commit to run.
set -u
OUT=${OUT:-/tmp/s11c_out}; R=/tmp/s11c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step tests_direct 200 $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k direct -p no:cacheprovider
  step probe_direct 200 $PY tools/probe_matmul.py --variants ${VARIANTS:-default,direct,direct_noautobar,pp6_inflight_direct} \
    --no-example --shapes 8192x8192x2048 8192x6144x2048 8192x2048x2048 8192x50304x2048 8192x8192x8192 \
      4096x4096x4096 16384x8192x2048 16384x2048x8192 --budget-s 150 --json "$OUT/probe_direct.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for spec in xla=xla pallas= direct='{"epilogue_store":"direct"}' ${STEP_EXTRA:-}; do
    gpt1b_probe "${spec%%=*}" "${spec#*=}"
  done
) &
wait
finish s11c 20
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
cp "$R"/gpt1b_probe*.json "$OUT/" 2>/dev/null
rm -f "$OUT/s11c.tar.gz"
