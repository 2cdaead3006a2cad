#!/usr/bin/env bash
# In-situ tiling comparison: the bench's optimised gpt-1b step with our Mosaic GPU kernel under
# several MatmulConfig overrides (tools/probe_gpt1b.py --matmul-config, one process each), one
# lane per GPU.
#   LANE0, LANE1  space-separated TAG=JSON specs, run in order on GPU 0 / GPU 1: JSON holds
#                 MatmulConfig fields over the shipped default (empty: the shipped config
#                 itself; the word xla: XLA's dot instead of our kernel). No spaces in JSON.
#                 Unset: the fourth session's sweep, each lane re-running the default; set but
#                 empty: that GPU runs nothing.
#   TESTS_K       optional pytest -k expression: those GPU kernel tests run first on GPU 0.
#   bash tools/gpu_matmul_configs.sh   # results in $OUT/mmcfg.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mmcfg_out}; R=/tmp/mmcfg; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
LANE0=${LANE0-'_base0= _64x256={"block_m":64,"block_n":256} _wgn={"wg_split":"n"} _inflight={"wgmma_in_flight":1}'}
LANE1=${LANE1-'_base1= _g8={"group_m":8} _noab={"no_auto_barriers":true} _64x256f1={"block_m":64,"block_n":256,"wgmma_in_flight":1}'}
lane() {  # lane GPU SPECS
  export CUDA_VISIBLE_DEVICES=$1
  if [ "$1" = 0 ] && [ -n "${TESTS_K:-}" ]; then
    step tests ${T_TESTS:-120} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k "$TESTS_K" -p no:cacheprovider
  fi
  local specs spec; read -ra specs <<< "$2"
  for spec in "${specs[@]}"; do tag=${spec%%=*}; T_P=${T_P:-75} gpt1b_probe "${tag#_}" "${spec#*=}"; done
}
lane 0 "$LANE0" & A=$!
lane 1 "$LANE1" & B=$!
wait $A $B
finish mmcfg 12
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"  # the probes' JSON rows at the end
