#!/usr/bin/env bash
# Seventh session, one call on the lent nvidia-h200-x2:
#   GPU 0: gpt-1b's optimised step with and without the bf16 weight copy in the state
#          (--compute-copy) and q/k/v from three products (--split-qkv), the four variants in
#          one process, then again in reverse order with a profile of the first; then
#          `bench train` gpt-1b with both switches (issue 6's table row).
#   GPU 1: the GPU tests of the models (split_qkv under cuDNN) and of the kernels' autotuner
#          (every layout; Triton needs jax-triton on PYTHONPATH), then the other kernel tests.
#   bash tools/gpu_session7.sh   # results in $OUT/s7.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s7_out}; R=/tmp/s7; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$R step probe_fwd ${T_P:-150} $PY tools/probe_gpt1b.py --variants opt,optcopy,optsplit,optboth --tag _fwd
  OUT=$R step probe_rev ${T_P:-150} $PY tools/probe_gpt1b.py --variants optboth,optsplit,optcopy,opt --tag _rev --profile
  step bench_both ${T_B:-110} $PY $GPT1B_BENCH --no-scaling --compute-copy --split-qkv --out "$R/bench_both"
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step tests_models ${T_M:-90} $PY -m pytest -q -m gpu tests/test_models.py -p no:cacheprovider
  step tests_autotune ${T_AT:-120} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -k autotune
  step tests_kernels ${T_K:-300} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "not autotune and not options"
) & B=$!
wait $A $B
finish s7 25
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
