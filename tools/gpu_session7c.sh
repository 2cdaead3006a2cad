#!/usr/bin/env bash
# Seventh session, third call on the lent nvidia-h200-x2:
#   GPU 0: issue 6's gpt-1b table with --ablate, the bf16 weight copy now on by default.
#   GPU 1: the probe's optcopy step with XLA's command buffers off, then on (control); then the
#          Triton and option-sweep kernel tests (jax-triton on PYTHONPATH) until the deadline.
#   bash tools/gpu_session7c.sh   # results in $OUT/s7c.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s7c_out}; R=/tmp/s7c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-480}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step gpt1b_ablate ${T_A:-460} $PY $GPT1B_BENCH --no-scaling --ablate --out "$R/gpt1b_ablate"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step probe_cb_off ${T_P:-80} $PY tools/probe_gpt1b.py --variants optcopy --tag _cb_off \
    --xla-extra=--xla_gpu_enable_command_buffer=
  OUT=$R step probe_cb_on ${T_P:-80} $PY tools/probe_gpt1b.py --variants optcopy --tag _cb_on
  step tests_triton ${T_K:-300} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "triton or options"
) & B=$!
wait $A $B
finish s7c 25
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
