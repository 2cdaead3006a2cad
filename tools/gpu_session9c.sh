#!/usr/bin/env bash
# Ninth session, call 3 (nvidia-h200-x2, ~4 min): issue 6's yardstick, a plain Flax NNX + optax
# gpt-1b loop (tools/probe_plain.py: f32 master "mixed" and bf16 "pure"; that script is in commit
# d59f46f and was removed after this call: its loop is now jaxopt_train/bench/plain.py, run by
# `bench train --compare-plain`, see tools/gpu_session9d.sh), against the bench's
# optimised step (tools/probe_gpt1b.py optcopy), one process each, on both GPUs in opposite
# orders so each GPU gives one same-GPU comparison.
#   bash tools/gpu_session9c.sh   # results in $OUT/s9c.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s9c_out}; R=/tmp/s9c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
mkdir -p "$R/g0" "$R/g1"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$R/g0 step plain_g0 150 $PY tools/probe_plain.py  # (commit d59f46f)
  OUT=$R/g0 step ours_g0 120 $PY tools/probe_gpt1b.py --variants optcopy --tag _g0
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R/g1 step ours_g1 120 $PY tools/probe_gpt1b.py --variants optcopy --tag _g1
  OUT=$R/g1 step plain_g1 150 $PY tools/probe_plain.py
) & B=$!
wait $A $B
finish s9c 6
grep -h '^\[probe\] {\|^\[plain\] {' "$R"/*.log >> "$OUT/summary.txt"
