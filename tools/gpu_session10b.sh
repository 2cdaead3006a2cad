#!/usr/bin/env bash
# Tenth session, call 2 (nvidia-h200-x2, <= 6 min): issue 4's exchange with the cast and the send
# fused into one Mosaic GPU kernel that stores into the peer's memory (tools/probe_nvshmem.py;
# one process per GPU). First the checks alone (NVSHMEM setup, a one-tile peer store, the exchange
# on 4 MiB of random data), then, if they pass, the timings against psum and the library.
#   bash tools/gpu_session10b.sh   # results in $OUT/s10b.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s10b_out}; R=/tmp/s10b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-340}
source "$(dirname "$0")/gpu_common.sh"
{ pip list 2>/dev/null | grep -i -E 'nvshmem|jax|nvidia'; ls /usr/lib/x86_64-linux-gnu | grep -i nvshmem; } > "$R/env.log" 2>&1
OUT=$R step check 130 $PY tools/probe_nvshmem.py --check-only --timeout 120
if grep -q '"checked": true' "$R/check.log" && ! grep -q '"checked": false' "$R/check.log"; then
  OUT=$R step time 200 $PY tools/probe_nvshmem.py --sizes ${SIZES:-16M,256M,1G} --timeout 190
fi
OUT=$R step single 70 $PY tools/probe_nvshmem.py --single --check-only
finish s10b 60
