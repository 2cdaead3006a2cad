#!/usr/bin/env bash
# Thirty-first session, call A (~8 min on nvidia-h200): the embedding fix seen by `bench train`.
#   t_embed     tests/test_models_embedding.py on the GPU (the Embed, LinenEmbed and Trainer
#               warning tests ran on CPU only last session)
#   b124_text   gpt-124m, batch 16, on byte windows of the embedded corpus (`--text`), with the
#               plain Flax + optax yardstick (`--compare-plain`), which keeps nnx.Embed and so
#               the bf16 scatter-add of its embedding gradient
#   b124_rand   the same on uniform random ids (no hot row): the control
#   b1b_text    the issue-6 gpt-1b table on the corpus (it ran on random ids until now)
#   bash tools/gpu_session31.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s31_out}; R=/tmp/s31; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
  --format=csv -l 1 > "$R/smi.csv" 2>&1 &
SMI=$!
STEP_TAIL=5 step t_embed 110 $PY -m pytest -q -p no:cacheprovider tests/test_models_embedding.py
B124="-m jaxopt_train.bench.train --model gpt-124m --global-batch 16 --microbatches 1 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --compare-plain"
STEP_TAIL=14 step b124_text 150 $PY $B124 --text --out $R/b124_text
STEP_TAIL=14 step b124_rand 150 $PY $B124 --out $R/b124_rand
STEP_TAIL=14 step b1b_text 170 $PY $GPT1B_BENCH --text --out $R/b1b_text
kill $SMI
finish s31 30
