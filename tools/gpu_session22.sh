#!/usr/bin/env bash
# Twenty-second session, call 1 (~9 min on nvidia-h200): remat "dots_attention" (new), which
# saves cuDNN attention's forward results so the backward does not rerun the forward.
# 1. the GPU model tests (new: one cuDNN forward per block under dots_attention, two under dots);
# 2. the same-process A/B of the gpt-1b step with remat on every block: dots vs dots_attention;
# 3. issue 6's gpt-1b-within-16-GiB row, whose search now tries dots_attention before dots
#    (twenty-first session: dots on the first 14 blocks, 93.02 ms, 52.1% MFU, 15.59 GiB).
#   bash tools/gpu_session22.sh
set -u
OUT=${OUT:-/tmp/s22_out}; R=/tmp/s22; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > "$R/gpu.log" 2>&1
STEP_TAIL=8 step models_gpu 100 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_models.py
OUT=$R STEP_TAIL=14 step probe_remat 170 $PY tools/probe_gpt1b.py --variants dots16,dotsattn16 \
  --warmup-s 15 --tag _remat
STEP_TAIL=16 step gpt1b_16g 290 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --memory-budget 16GiB \
  --out "$R/gpt1b_16g"
cp "$R"/gpt1b_16g/train_bench.png "$OUT/gpt1b_16g_train_bench.png" 2>/dev/null
finish s22 20
