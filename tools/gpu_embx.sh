#!/usr/bin/env bash
# 2-GPU call: the data-parallel GPT step with and without the embedding-gradient exchange
# (bench collectives --gpt --gpt-embedding-exchange), on issue 4's gpt-124m/2-layer step (with
# profiles) and on gpt-1b (issue 6's scaling model).
#   bash tools/gpu_embx.sh     # results in $OUT/embx.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/embx_out}; R=/tmp/embx; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
COLL="-m jaxopt_train.bench.collectives --sizes 1M --dtypes f32 --chunks 1 --methods ring --gpt \
  --gpt-grad-dtype compute --gpt-embedding-exchange"
step small ${T_S:-150} $PY $COLL --gpt-config gpt-124m --gpt-overrides n_layers=2,dtype=bfloat16 \
  --gpt-batch 8 --gpt-methods psum,ring --gpt-iters 10 --gpt-trace "$R/tr_small" --json "$R/small.json"
step big ${T_B:-240} $PY $COLL --gpt-config gpt-1b --gpt-overrides dtype=bfloat16,attention=cudnn \
  --gpt-batch 8 --gpt-methods psum --gpt-iters 5 --json "$R/big.json"
rm -rf "$R"/tr_small
finish embx
