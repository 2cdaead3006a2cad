#!/usr/bin/env bash
# Eighteenth session, call 3 (~7 min on nvidia-h200):
# 1. `_transposed` now calls `ref.transpose((1, 0))` (what the deprecated plgpu.transpose_ref
#    did): the 89 Mosaic GPU tests that read a transposed operand or take a gradient, in two
#    pytest processes sharing GPU 0 (correctness only, nothing timed beside them).
# 2. Then, alone on the GPU: the issue-5 table on the defaults of this tree (Triton's
#    four-stage tile and 16-byte row padding are new since the seventeenth session's table), no
#    autotune cache, Mosaic GPU and Triton beside XLA's dot.
#   bash tools/gpu_session18c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s18c_out}; R=/tmp/s18c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0 JAXOPT_TRAIN_CACHE_DIR=$R/nocache
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
$T --collect-only tests/test_kernels_gpu.py -k "not triton and (transpose or gradient or tied_head or pingpong)" \
  2>/dev/null | grep '::' > "$R/ids.txt"
awk 'NR % 2 == 1' "$R/ids.txt" > "$R/ids_a.txt"; awk 'NR % 2 == 0' "$R/ids.txt" > "$R/ids_b.txt"
echo "transposed/gradient tests: $(wc -l < "$R/ids.txt")" | tee -a "$R/steps.log"
STEP_TAIL=3 step k_t_a 260 $T $(cat "$R/ids_a.txt") > /dev/null &
STEP_TAIL=3 step k_t_b 260 $T $(cat "$R/ids_b.txt") > /dev/null &
wait; grep -h "passed\|failed" "$R"/k_t_*.log | tail -n 4
STEP_TAIL=40 step mm 260 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu,triton --warmup-s 4 \
  --no-layer --json "$OUT/mm.json"
finish s18c 20
