#!/usr/bin/env bash
# Paired re-measure of chained tile pipelines in the gpt-1b step: on each GPU, the bench's
# optimised step (tools/probe_gpt1b.py) alternates XLA's dot and our kernel with
# chain_tiles ($PAIRS times, default 2; a chained compile takes ~60 s), so every pallas run has an XLA run next to it on the same GPU.
#   bash tools/gpu_chain_pairs.sh   # results in $OUT/chain_pairs.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/chain_pairs_out}; R=/tmp/chain_pairs; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-210}
source "$(dirname "$0")/gpu_common.sh"
CHAIN='{"chain_tiles":true}'
probe() { OUT=$R step "step$1" ${T_P:-85} $PY tools/probe_gpt1b.py --variants opt --tag "$1" "${@:2}"; }
lane() {  # lane GPU: $PAIRS pairs; GPU 1 runs each pair in the opposite order
  export CUDA_VISIBLE_DEVICES=$1; local i
  for i in $(seq "${PAIRS:-2}"); do
    if [ "$1" = 0 ]; then probe "_g$1_xla$i"; fi
    probe "_g$1_chain$i" --matmul pallas --matmul-config "$CHAIN"
    if [ "$1" = 1 ]; then probe "_g$1_xla$i"; fi
  done
}
lane 0 & A=$!
lane 1 & B=$!
wait $A $B
finish chain_pairs 6
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
