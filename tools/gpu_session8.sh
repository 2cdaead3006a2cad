#!/usr/bin/env bash
# Eighth session, call 2 (nvidia-h200-x2, ~5 min): the bf16 wire after the pin.
#   GPU tests of the pinned wire (tests/test_collectives_gpu.py: bit-identical replicas);
#   tools/probe_wire.py over every variant, default flags then the latency-hiding scheduler;
#   bench collectives' f32 / bf16-wire rows for BENCHMARKS.md.
#   bash tools/gpu_session8.sh   # results in $OUT/s8.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s8_out}; R=/tmp/s8; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
step gpu_tests 120 $PY -m pytest -q -m gpu tests/test_collectives_gpu.py -p no:cacheprovider
OUT=$R step wire 120 $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3 --hlo "$R/hlo"
mv "$R/wire_probe.json" "$R/wire_probe_default.json" 2>/dev/null
XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true OUT=$R step wire_lhs 90 $PY tools/probe_wire.py \
  --sizes 256M,1G --iters 10 --bursts 3 --variants lib,dus2,dus4,cat2
step coll 120 $PY -m jaxopt_train.bench.collectives --sizes 1G,256M,16M --dtypes f32 --chunks 1 \
  --iters 10 --bursts 3 --methods ring,ring_wire_bf16 --json "$R/collectives.json"
finish s8 40
