#!/usr/bin/env bash
# 2-CTA clusters (TMA multicast) now that they also read transposed operands as stored: the
# kernel's cluster GPU tests, then the bench's optimised gpt-1b step (tools/probe_gpt1b.py)
# with XLA's dot, our shipped config, and cluster="m" / "n" for every launch.
#   bash tools/gpu_cluster_t.sh   # results in $OUT/cluster_t.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/cluster_out}; R=/tmp/cluster_t; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
probe() { OUT=$R step "step$1" ${T_P:-70} $PY tools/probe_gpt1b.py --variants opt --tag "$1" "${@:2}"; }
(
  export CUDA_VISIBLE_DEVICES=0
  step tests ${T_TESTS:-120} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -k "cluster" -p no:cacheprovider
  probe _cm --matmul pallas --matmul-config '{"cluster":"m"}'
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  probe _xla
  probe _coop --matmul pallas
  probe _cn --matmul pallas --matmul-config '{"cluster":"n"}'
) & B=$!
wait $A $B
finish cluster_t 12
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
