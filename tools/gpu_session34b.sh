#!/usr/bin/env bash
# Thirty-fourth session, call B (~4 min on nvidia-h200): the two tests changed after call A
# (the pallas-in-shard_map step compared norm-wise; bench train's frozen collector), then the
# issue-6 one-GPU gpt-1b table with bench train's collector frozen (f0124d3).
#   bash tools/gpu_session34b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s34b_out}; R=/tmp/s34b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-400}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
STEP_TAIL=3 step t_changed 120 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_train.py \
  tests/test_bench_train.py -k "pallas_matmul_trains_like_xla_inside_shard_map or collector_frozen"
STEP_TAIL=14 step gpt1b 200 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 --out $R/gpt1b
cp $R/gpt1b/*.json $R/gpt1b/*.png "$OUT/" 2>/dev/null
finish s34b 14
