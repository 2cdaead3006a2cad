#!/usr/bin/env bash
# Tenth session, call 3 (nvidia-h200-x2, <= 8 min): the peer all-reduce (collectives.peer: one
# Mosaic GPU kernel storing into the other GPU) as the library now ships it.
#   1. the collectives' GPU tests (bit-identical peer sums, odd sizes, tree + bf16 error feedback);
#   2. bench collectives: psum, ring, bf16-wire ring, peer, bf16-wire peer, 1 MiB..1 GiB, f32 and bf16;
#   3. the data-parallel gpt-124m step (12 layers, bf16 gradients) with psum, ring and peer;
#   4. the trainer on both GPUs, gpt-tiny, --grad-sync psum vs peer (same losses expected).
#   bash tools/gpu_session10c.sh   # results in $OUT/s10c.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s10c_out}; R=/tmp/s10c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-470}
source "$(dirname "$0")/gpu_common.sh"
step tests 150 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_collectives_gpu.py
step coll 130 $PY -m jaxopt_train.bench.collectives --sizes 1G,256M,16M,1M --dtypes f32,bf16 --chunks 1 \
  --iters 10 --bursts 3 --methods ring,ring_wire_bf16,peer,peer_wire_bf16 --json "$R/coll_peer.json"
step dp 120 $PY -m jaxopt_train.bench.collectives --sizes 1M --dtypes f32 --chunks 1 --methods ring --gpt \
  --gpt-grad-dtype compute --gpt-config gpt-124m --gpt-batch 8 --gpt-iters 10 \
  --gpt-overrides dtype=bfloat16 --gpt-methods psum,ring,peer --json "$R/dp_peer.json"
for gs in psum peer; do
  step "train_$gs" 60 $PY -m jaxopt_train.train.cli --preset gpt-tiny --steps 30 --log-every 10 \
    --eval-every 0 --checkpoint-every 0 --progress lines --overwrite --grad-sync $gs \
    --run-dir "$R/run_$gs"
done
finish s10c 40
