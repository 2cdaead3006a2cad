#!/usr/bin/env bash
# In-situ tiling comparison: the bench's optimised gpt-1b step with our Mosaic GPU kernel under
# several MatmulConfig overrides (tools/probe_gpt1b.py --matmul-config, one process each), one
# lane per GPU, each lane re-running the shipped default as its control.
#   bash tools/gpu_matmul_configs.sh   # results in $OUT/mmcfg.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mmcfg_out}; R=/tmp/mmcfg; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
probe() {  # probe TAG JSON
  OUT=$R step "cfg$1" ${T_P:-75} $PY tools/probe_gpt1b.py --variants opt --matmul pallas --tag "$1" \
    ${2:+--matmul-config "$2"}
}
lane() {  # lane GPU "TAG=JSON"...
  export CUDA_VISIBLE_DEVICES=$1; shift
  local spec; for spec in "$@"; do probe "${spec%%=*}" "${spec#*=}"; done
}
lane 0 "_base0=" '_64x256={"block_m":64,"block_n":256}' '_wgn={"wg_split":"n"}' \
  '_inflight={"wgmma_in_flight":1}' & A=$!
lane 1 "_base1=" '_g8={"group_m":8}' '_noab={"no_auto_barriers":true}' \
  '_64x256f1={"block_m":64,"block_n":256,"wgmma_in_flight":1}' & B=$!
wait $A $B
finish mmcfg
grep -h '^\[probe\] {' "$R"/*.log > "$OUT/summary.txt"  # the probes' JSON rows only
