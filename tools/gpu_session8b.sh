#!/usr/bin/env bash
# Eighth session, call 3 (nvidia-h200-x2, ~2 min): the bf16-wire exchange with its casts chained
# (tools/probe_wire.py ovl2/ovl4: cast i+1 while piece i is on the wire), default XLA flags and
# with the latency-hiding scheduler, optimised HLO kept.   bash tools/gpu_session8b.sh
set -u
OUT=${OUT:-/tmp/s8b_out}; R=/tmp/s8b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/gpu_common.sh"
OUT=$R step wire 100 $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3 --variants lib,ovl2,ovl4 \
  --hlo "$R/hlo"
XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true OUT=$R step wire_lhs 100 $PY tools/probe_wire.py \
  --sizes 256M,1G --iters 10 --bursts 3 --variants lib,ovl2,ovl4 --hlo "$R/hlo_lhs"
finish s8b 20
