#!/usr/bin/env bash
# What the seventh session left unmeasured, for the lent nvidia-h200-x2, in one call (~8 min):
#   both GPUs: tools/probe_wire.py (issue 4's bf16 wire: the library's exchange against an
#              optimization_barrier on the bf16 buffer, two halves, and NCCL's bf16 psum;
#              each checked bit-equal on random data), then issue 6's 2-GPU gpt-1b table with
#              the bf16 weight copy now on by default (scaling target >= 95%);
#   GPU 0:     the new default step with a profile (tools/probe_gpt1b.py --profile), for the
#              time breakdown of what is left to issue 6's 64% MFU.
#   bash tools/gpu_next7.sh   # results in $OUT/next7.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/next7_out}; R=/tmp/next7; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-530}
source "$(dirname "$0")/gpu_common.sh"
OUT=$R step wire ${T_W:-90} $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3
step gpt1b_x2 ${T_X2:-240} $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --out "$R/gpt1b_x2"
CUDA_VISIBLE_DEVICES=0 OUT=$R step profile ${T_P:-120} $PY tools/probe_gpt1b.py --variants optcopy \
  --profile --tag _profile
finish next7 30
