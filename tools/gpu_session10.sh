#!/usr/bin/env bash
# Tenth session, call 1 (nvidia-h200-x2, <= 4 min): issue 4's 2-device exchange with NCCL's
# all-gather as the transport instead of ppermute's send/recv (tools/probe_wire.py variants
# ag / ag_f32), next to the library's exchange (lib / lib_f32), psum f32 and psum of bf16,
# at 16 MiB, 256 MiB and 1 GiB; then once more in the other order (order check).
#   bash tools/gpu_session10.sh   # results in $OUT/s10.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s10_out}; R=/tmp/s10; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-230}
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$R/smi.log" 2>&1
OUT=$R step wire_a 100 $PY tools/probe_wire.py --sizes 16M,256M,1G --iters 10 --bursts 3 \
  --variants lib,ag,lib_f32,ag_f32,psum_bf16 --hlo "$R/hlo"
mv "$R/wire_probe.json" "$R/wire_a.json" 2>/dev/null
OUT=$R step wire_b 80 $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3 --variants ag_f32,ag,lib
mv "$R/wire_probe.json" "$R/wire_b.json" 2>/dev/null
finish s10 40
