#!/usr/bin/env bash
# The GPU tests named in a file of pytest node ids (one per line), in PROCS pytest processes
# sharing GPU 0 (allocator not preallocated), each given every PROCS-th id:
#   bash tools/gpu_ids.sh IDS_FILE [PROCS]   # carry [".whl"] so jax-triton imports
# For the ids a capped tools/gpu_session18b.sh did not reach: its k_main_a.txt / k_main_b.txt past the
# count of dots in k_main_a.log / k_main_b.log (forty-seventh session: 44 ids, 3 processes, 174 s).
set -u
IDS=${1:?usage: bash tools/gpu_ids.sh IDS_FILE [PROCS]}; PROCS=${2:-3}
[ -s "$IDS" ] || { echo "no node ids in $IDS" >&2; exit 2; }
OUT=${OUT:-/tmp/ids_out}; R=/tmp/ids; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
run_id_parts ids "$IDS" "$PROCS" 540 || exit 2
wait
finish ids 12
