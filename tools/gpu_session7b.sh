#!/usr/bin/env bash
# Seventh session, second call on the lent nvidia-h200-x2:
#   GPU 0: `bench train` gpt-1b with --compute-copy at steps_per_dispatch 1 (the table row) and,
#          in the same run, k = 2 and 4 (--compare-dispatch); then the same command with bursts
#          twice as long (--steps 60), to see how much of the step is per-burst start/stop cost.
#   GPU 1: the models' GPU tests (split_qkv under cuDNN, fixed to an even length), then the
#          probe's optcopy step with XLA's command buffers off and, as control, on.
#   bash tools/gpu_session7b.sh   # results in $OUT/s7b.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s7b_out}; R=/tmp/s7b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  step bench_k ${T_K:-230} $PY $GPT1B_BENCH --no-scaling --compute-copy --compare-dispatch 2,4 --out "$R/bench_k"
  step bench_long ${T_L:-150} $PY $GPT1B_BENCH --no-scaling --compute-copy --steps 60 --out "$R/bench_long"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step tests_models ${T_M:-90} $PY -m pytest -q -m gpu tests/test_models.py -p no:cacheprovider
  OUT=$R step probe_cb_off ${T_P:-100} $PY tools/probe_gpt1b.py --variants optcopy --tag _cb_off \
    --xla-extra "--xla_gpu_enable_command_buffer="
  OUT=$R step probe_cb_on ${T_P:-100} $PY tools/probe_gpt1b.py --variants optcopy --tag _cb_on
) & B=$!
wait $A $B
finish s7b 25
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
