#!/usr/bin/env bash
# Twelfth session, call 2 (nvidia-h200-x2, <= 9.5 min): the head's weight gradient without padding.
# GPU 0: the GPU tests of the tied head and the transposed/gradient paths, then the bench's
#   optimised gpt-1b step with our kernel (profiled: every kernel's time) and with XLA's dot.
# GPU 1: the same two steps in the opposite order, then XLA's step with 12 bursts while
#   nvidia-smi samples both GPUs' SM clock and power every 100 ms (and
#   nvidia-smi -q's throttle reasons once, mid-run).
#   bash tools/gpu_session12b.sh   # results in $OUT/summary.txt, $OUT/*.json, $OUT/smi.csv
set -u
OUT=${OUT:-/tmp/s12b_out}; R=/tmp/s12b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step tests_head 150 $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "tied_head or backward_reads or transpose_b_reads or gradients_match or forward_matches_reference"
  OUT=$R step prof_pallas 170 $PY tools/probe_gpt1b.py --variants opt --profile --tag _prof_pallas --matmul pallas
  gpt1b_probe g0_xla xla
) &
(
  export CUDA_VISIBLE_DEVICES=1
  gpt1b_probe g1_pallas ""
  gpt1b_probe g1_xla xla
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 & SMI=$!
  (sleep 40; nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > "$OUT/smi_q.txt" 2>&1) &
  OUT=$R step bursts12 150 $PY tools/probe_gpt1b.py --variants optcopy --tag _bursts12 --bursts 12
  kill $SMI
) &
wait
finish s12b 12 --exclude=*.trace.json.gz --exclude=*.xplane.pb --exclude=hlo_*
grep -h '^\[probe\] {' "$R"/*.log > "$OUT/rows.txt"
cp "$R"/gpt1b_probe_prof_*.json "$OUT/" 2>/dev/null
tail -n 30 "$OUT/summary.txt"
