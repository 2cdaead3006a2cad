#!/usr/bin/env bash
# Seventh session, last call on the lent nvidia-h200-x2 (~4 min of device time left):
#   GPU 0: issue 6's gpt-1b table (`bench train`, defaults) with models.activations.gelu_tanh,
#          whose backward keeps only its input.
#   GPU 1: the probe's optcopy step with gelu_tanh against jax.nn.gelu's autodiff, in one
#          process, then again in the other order.
#   bash tools/gpu_session7d.sh   # results in $OUT/s7d.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s7d_out}; R=/tmp/s7d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-190}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step gpt1b ${T_B:-150} $PY $GPT1B_BENCH --no-scaling --out "$R/gpt1b"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step probe_fwd ${T_P:-95} $PY tools/probe_gpt1b.py --variants optcopy,optcopy_jaxgelu --tag _fwd
  OUT=$R step probe_rev ${T_P:-95} $PY tools/probe_gpt1b.py --variants optcopy_jaxgelu,optcopy --tag _rev
) & B=$!
wait $A $B
finish s7d 20
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
