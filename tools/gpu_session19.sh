#!/usr/bin/env bash
# Prepared in the eighteenth session for the first call on nvidia-h200-x2 (~7 min): only the
# one-GPU kind was lent in the fifteenth to eighteenth sessions, so the two-GPU pieces have not
# run since the sixteenth (collective tests) and thirteenth (2-GPU table) sessions.
# 1. The 14 collective GPU tests (ring, bf16 wire, peer all-reduce kernel; both GPUs).
# 2. Issue 6's 2-GPU table (data parallel, the optimised step rerun on one GPU for the
#    scaling figure), as the twelfth and thirteenth sessions measured it.
#   bash tools/gpu_session19.sh   # on nvidia-h200-x2; carry [".whl"] is not needed
set -u
OUT=${OUT:-/tmp/s19_out}; R=/tmp/s19; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi topo -m > "$R/topo.txt" 2>&1
STEP_TAIL=6 step collectives 120 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_collectives_gpu.py
STEP_TAIL=14 step bench2 400 $PY $GPT1B_BENCH --global-batch 16 --warmup-s 15 --out "$OUT/gpt1b_2gpu"
finish s19 25
