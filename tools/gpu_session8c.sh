#!/usr/bin/env bash
# Eighth session, call 4 (nvidia-h200-x2, ~5 min): issue 6's 2-GPU gpt-1b table twice more, with the
# bf16 weight copy (the default) and without it, to tell a change of the 2-GPU step from a change of
# the 1-GPU denominator (call 1: scaling 93.6% with the copy; 94.9-95.1% without it in session 5).
#   bash tools/gpu_session8c.sh   # results in $OUT/s8c.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s8c_out}; R=/tmp/s8c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
X2="-m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 --warmup 5 --bursts 3 \
  --trace-steps 5 --steps-per-dispatch 1"
step copy 270 $PY $X2 --out "$R/copy"
step nocopy 270 $PY $X2 --no-compute-copy --out "$R/nocopy"
finish s8c 30
