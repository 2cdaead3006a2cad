#!/usr/bin/env bash
# Chained tile pipelines (MatmulConfig.chain_tiles) and whole-tile epilogues in the gpt-1b
# step: the GPU tests of schedules that carry barrier state across tiles, then the bench's
# optimised step (tools/probe_gpt1b.py) under each override, one process each, one lane per
# GPU, with XLA's dot and the shipped config as controls.
#   bash tools/gpu_chain.sh   # results in $OUT/chain.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/chain_out}; R=/tmp/chain; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
probe() { OUT=$R step "step$1" ${T_P:-70} $PY tools/probe_gpt1b.py --variants opt --tag "$1" "${@:2}"; }
(
  export CUDA_VISIBLE_DEVICES=0
  step tests ${T_TESTS:-100} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k "several_tiles and chained" -p no:cacheprovider
  probe _chain --matmul pallas --matmul-config '{"chain_tiles":true}'
  probe _chain_epi128 --matmul pallas --matmul-config '{"chain_tiles":true,"epilogue_tile":128}'
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  probe _xla
  probe _coop --matmul pallas
  probe _epi128 --matmul pallas --matmul-config '{"epilogue_tile":128}'
) & B=$!
wait $A $B
finish chain 12
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
