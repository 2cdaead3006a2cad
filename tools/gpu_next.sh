#!/usr/bin/env bash
# What the fifth session left unmeasured, for the lent nvidia-h200-x2, in two calls:
#   PHASE=A  lane 0: the GPU kernel tests except the option sweeps and Triton, then
#                    `bench matmul` (issue 5's 8192^3 / geomean rows, chained default);
#            lane 1: the option sweeps and Triton kernel tests (jax-triton on PYTHONPATH).
#   PHASE=B  both GPUs: the trainer's gpt-1b step with --zero 3 / 1 / 0 (bf16 gradients
#            and moments as in GPT1B_TRAIN) (8 sequences per GPU), then `bench collectives --gpt --gpt-zero1`
#            (issue 4's DP step, gpt-124m with 2 layers).
#   PHASE=A bash tools/gpu_next.sh   # results in $OUT/next_A.tar.gz and $OUT/summary.txt
set -u
PHASE=${PHASE:-A}
OUT=${OUT:-/tmp/next_out}; R=/tmp/next_$PHASE; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
if [ "$PHASE" = A ]; then
  (
    export CUDA_VISIBLE_DEVICES=0
    step tests_main ${T_TESTS:-300} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
      -k "not triton and not options"
    step bench_matmul ${T_MM:-200} $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
      --calls 10 --bursts 3 --warmup-s 0.3 --json "$R/matmul.json"
  ) & A=$!
  (
    export CUDA_VISIBLE_DEVICES=1
    step tests_options ${T_TESTS:-300} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
      -k "triton or options"
  ) & B=$!
  wait $A $B
else
  for z in 3 1 0; do  # GPT1B_TRAIN already asks for --grad-dtype compute --opt-state-dtype bf16
    step "train_zero$z" ${T_TRAIN:-100} $PY $GPT1B_TRAIN --batch-size 16 --zero "$z" --run-dir "/tmp/run_zero$z"
  done
  step coll_gpt ${T_COLL:-150} $PY -m jaxopt_train.bench.collectives --sizes 1M --dtypes f32 --chunks 1 \
    --methods ring --gpt --gpt-grad-dtype compute --gpt-zero1 --gpt-config gpt-124m \
    --gpt-overrides n_layers=2,dtype=bfloat16 --gpt-batch 8 --gpt-methods psum --gpt-iters 10 \
    --json "$R/coll.json"
fi
finish "next_$PHASE" 30
