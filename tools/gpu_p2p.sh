#!/usr/bin/env bash
# One 2-GPU device call: does a copy-engine ppermute (XLA's --xla_gpu_use_memcpy_local_p2p) or
# NCCL's P2P channel settings lift the ring above psum, and the DP step/scaling with it?
#   bash tools/gpu_p2p.sh        # results in $OUT/p2p.tar.gz and $OUT/summary.txt
# Each variant is its own process (XLA_FLAGS and NCCL settings are read once per process).
set -u
OUT=${OUT:-/tmp/p2p_out}; R=/tmp/p2p; mkdir -p "$R" "$OUT"
source "$(dirname "$0")/gpu_common.sh"
MEMCPY=--xla_gpu_use_memcpy_local_p2p=true
COLL="-m jaxopt_train.bench.collectives --sizes ${SIZES:-1G,256M,16M} --dtypes f32 --chunks 1 \
  --iters 10 --bursts 3 --methods ring,ring_wire_bf16"
GPT="--gpt --gpt-config gpt-124m --gpt-overrides n_layers=2,dtype=bfloat16 --gpt-batch 8 \
  --gpt-methods psum,ring --gpt-iters 10 --gpt-grad-dtype compute"
case ${PART:-12} in *1*)
  XLA_FLAGS=$MEMCPY step coll_memcpy ${T_C:-90} $PY $COLL $GPT --json "$R/coll_memcpy.json"
  step coll_default ${T_C:-90} $PY $COLL $GPT --json "$R/coll_default.json"
  NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=1048576 \
    step coll_ncclp2p ${T_C2:-60} $PY $COLL --json "$R/coll_ncclp2p.json"
  NCCL_MIN_NCHANNELS=32 NCCL_BUFFSIZE=16777216 \
    step coll_ncclch ${T_C2:-60} $PY $COLL --json "$R/coll_ncclch.json"
esac
case ${PART:-12} in *2*)
  OUT=$R step dp ${T_DP:-260} $PY tools/probe_dp.py --phases ${DP_PHASES:-A-memcpy,A-cb} --budget ${DP_BUDGET:-240} ${DP_ARGS:-}
esac
finish p2p 45
