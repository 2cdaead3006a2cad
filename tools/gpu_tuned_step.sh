#!/usr/bin/env bash
# Issue 5's gpt-1b step with per-shape autotuned configs, on the lent nvidia-h200-x2:
#   GPU 0: `autotune --quick` on the shape buckets of gpt-1b's products in the layouts the step
#          launches them (A @ B: the layers' forward and the head's dA; A @ B^T: the layers' dX
#          and the tied head's forward; A^T @ B: every dW), then the bench's optimised gpt-1b
#          step with our kernel reading that cache, then the same step with XLA's dot;
#   GPU 1 (controls, same time): XLA's step, then our kernel with the shipped default; with
#          COPY=1 then `bench train` gpt-1b without and with --compute-copy (one process each).
# The sixth session ran an earlier form that tuned the plain layout only (its winners then
# served the transposed products too): 1.048x XLA against the default's 1.031x.
#   COPY=1 bash tools/gpu_tuned_step.sh   # results in $OUT/tuned.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/tuned_out}; R=/tmp/tuned; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
# tokens T=8192, d=2048, 4d=8192, vocab V=50304 (M x N x K): forward T x out x in, dX T x in x out
# (B^T), dW in x out x T (A^T); tied head: forward T x V x d (B^T), dA T x d x V, dB V x d x T (A^T)
PLAIN=8192x8192x2048,8192x2048x2048,8192x2048x8192,8192x2048x50304
B_T=8192x2048x8192,8192x2048x2048,8192x8192x2048,8192x50304x2048
A_T=2048x8192x8192,2048x2048x8192,8192x2048x8192,50304x2048x8192
(
  export CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/cache
  for layout in plain b a; do
    case $layout in plain) shapes=$PLAIN; flag=();; b) shapes=$B_T; flag=(--transposed b);;
                    a) shapes=$A_T; flag=(--transposed a);; esac
    step "autotune_$layout" ${T_AT:-100} $PY -m jaxopt_train.kernels.autotune --backend mosaic_gpu \
      --quick --budget-s ${AT_BUDGET:-18} --shapes $shapes "${flag[@]}"
  done
  OUT=$R step step_tuned0 ${T_P:-85} $PY tools/probe_gpt1b.py --variants opt --tag _tuned0 --matmul pallas
  OUT=$R step step_xla0 ${T_X:-50} $PY tools/probe_gpt1b.py --variants opt --tag _xla0
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$R step step_xla1 ${T_X:-50} $PY tools/probe_gpt1b.py --variants opt --tag _xla1
  OUT=$R step step_shipped1 ${T_P:-85} $PY tools/probe_gpt1b.py --variants opt --tag _shipped1 --matmul pallas
  if [ -n "${COPY:-}" ]; then  # bench train's optimised gpt-1b row without, then with --compute-copy
    for copy in "" --compute-copy; do
      step "bench${copy:-_nocopy}" ${T_B:-100} $PY $GPT1B_BENCH --no-scaling $copy --json "$R/bench${copy:-_nocopy}.json"
    done
  fi
) & B=$!
wait $A $B
finish tuned 20
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"  # the probes' JSON rows at the end
