#!/usr/bin/env bash
# The ping-pong Mosaic GPU schedule on one call of the lent nvidia-h200-x2:
#   lane 0: its GPU kernel tests, then gpt-1b's layer products (tools/probe_matmul_bwd.py)
#           for the shipped cooperative config and both ping-pong variants;
#   lane 1: the bench's optimised gpt-1b step (tools/probe_gpt1b.py) with XLA's dot, our
#           kernel's shipped config, and the two ping-pong variants, one process each.
#   bash tools/gpu_pingpong.sh   # results in $OUT/pingpong.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/pingpong_out}; R=/tmp/pingpong; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
PP='{"schedule":"pingpong"}'
PP1='{"schedule":"pingpong","wgmma_in_flight":1}'
(
  export CUDA_VISIBLE_DEVICES=0
  step tests ${T_TESTS:-200} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k "pingpong" -p no:cacheprovider
  OUT=$R step products ${T_PRODUCTS:-200} $PY tools/probe_matmul_bwd.py --configs "pingpong=$PP" "pingpong_f1=$PP1"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step step_xla ${T_P:-80} $PY tools/probe_gpt1b.py --variants opt --tag _xla
  OUT=$R step step_coop ${T_P:-80} $PY tools/probe_gpt1b.py --variants opt --matmul pallas --tag _coop
  OUT=$R step step_pp ${T_P:-80} $PY tools/probe_gpt1b.py --variants opt --matmul pallas --tag _pp --matmul-config "$PP"
  OUT=$R step step_pp1 ${T_P:-80} $PY tools/probe_gpt1b.py --variants opt --matmul pallas --tag _pp1 --matmul-config "$PP1"
) & B=$!
wait $A $B
finish pingpong 40
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
