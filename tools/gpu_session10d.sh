#!/usr/bin/env bash
# Tenth session, call 4 (nvidia-h200-x2, <= 6 min, carry [".whl"] not needed): after the
# kernel_io_kwargs refactor (plgpu.kernel's keyword spelling now shared by the matmul and the peer
# all-reduce), the Mosaic GPU matmul's forward / gradient / fused-epilogue GPU tests on GPU 0 while
# GPU 1 is idle; then on both GPUs the collectives' GPU tests and a second `bench collectives`
# sample of the peer kernel (f32 data, 16 MiB to 1 GiB, to place the crossover with psum).
#   bash tools/gpu_session10d.sh   # results in $OUT/s10d.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s10d_out}; R=/tmp/s10d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
CUDA_VISIBLE_DEVICES=0 step kernels 170 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "mosaic_gpu and (forward_matches_reference or gradients_match_reference or fused_epilogue)"
step tests 60 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_collectives_gpu.py
step coll 90 $PY -m jaxopt_train.bench.collectives --sizes 1G,256M,64M,16M --dtypes f32 --chunks 1 \
  --iters 10 --bursts 3 --methods ring,ring_wire_bf16,peer,peer_wire_bf16 --json "$R/coll_peer2.json"
finish s10d 40
cp "$R/coll_peer2.json" "$OUT/" 2>/dev/null
