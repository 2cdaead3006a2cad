#!/usr/bin/env bash
# Thirty-first session, call B (~9 min on nvidia-h200):
#   t_cpu_tests  the embedding tests (the 8-device sharding test now on the emulated CPU devices)
#                and the optimizer-state / rounding / precision tests of this session's fixes
#   b124_text    call A's gpt-124m --text --compare-plain again, with the time its fourth row
#                needed (call A's step limit cut it off after the plain f32-master row)
#   b1b_text     the issue-6 gpt-1b table on the corpus with the plain yardstick: the plain
#                loop keeps nnx.Embed (a bf16 scatter-add of the embedding gradient)
#   bash tools/gpu_session31b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s31b_out}; R=/tmp/s31b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-575}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
  --format=csv -l 1 > "$R/smi.csv" 2>&1 &
SMI=$!
STEP_TAIL=4 step t_tests 90 $PY -m pytest -q -p no:cacheprovider tests/test_models_embedding.py \
  tests/test_optim.py tests/test_stochastic_round.py tests/test_precision_edges.py
B124="-m jaxopt_train.bench.train --model gpt-124m --global-batch 16 --microbatches 1 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --compare-plain"
STEP_TAIL=16 step b124_text 215 $PY $B124 --text --out $R/b124_text
STEP_TAIL=16 step b1b_text 260 $PY $GPT1B_BENCH --text --compare-plain --out $R/b1b_text
kill $SMI
finish s31b 30
