#!/usr/bin/env bash
# Ninth session, call 4 (nvidia-h200-x2, ~7 min): `bench train --compare-plain` (the plain Flax +
# optax yardstick rows, now part of the bench) on gpt-1b:
#   GPU 0, 1:  one GPU each, at the same time (two samples of the issue-6 table with the plain rows);
#   both:      the 2-GPU table with the plain rows (plain jit data parallelism: replicated params,
#              sharded batch, XLA's gradient all-reduce), then the bench's GPU test.
#   (on a one-GPU machine: LANES=0 SKIP_X2=1)
#   bash tools/gpu_session9d.sh   # results in $OUT/s9d.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s9d_out}; R=/tmp/s9d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500}
source "$(dirname "$0")/gpu_common.sh"
for g in ${LANES:-0 1}; do
  ( export CUDA_VISIBLE_DEVICES=$g
    step plain1_gpu$g 170 $PY $GPT1B_BENCH --no-scaling --compare-plain --out "$R/gpt1b_plain_gpu$g" ) &
done
wait
[ -n "${SKIP_X2:-}" ] || step plain2 230 $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 --warmup 5 \
  --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --compare-plain --out "$R/gpt1b_x2_plain"
step gputest 60 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_bench_train.py
finish s9d 30
