#!/usr/bin/env bash
# Thirty-ninth session, final tree: every GPU-marked test on ONE GPU, as tools/gpu_session18b.sh
# with TRITON=1, but the other modules' GPU tests first (they include this session's new
# tests/test_kernels_flax_layers.py GPU test; at the end, 18b's deadline has cut them before),
# then the kernel tests in four processes sharing GPU 0.
#   bash tools/gpu_session39b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s39b_out}; R=/tmp/s39b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
install_whl
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
$T --collect-only tests/test_kernels_gpu.py -k "not triton and not options" 2>/dev/null \
  | grep '::' > "$R/main_ids.txt"
awk 'NR % 2 == 1' "$R/main_ids.txt" > "$R/main_a.txt"
awk 'NR % 2 == 0' "$R/main_ids.txt" > "$R/main_b.txt"
echo "main tests: $(wc -l < "$R/main_ids.txt")" | tee -a "$R/steps.log"
$PY -c "import os, runpy; runpy.run_path('tests/conftest.py'); print('conftest XLA_FLAGS:', repr(os.environ.get('XLA_FLAGS')))" \
  2>&1 | tail -1 | tee -a "$R/steps.log"
STEP_TAIL=8 step others 150 $T tests --ignore=tests/test_kernels_gpu.py
STEP_TAIL=4 step k_triton 420 $T tests/test_kernels_gpu.py -k triton &
STEP_TAIL=4 step k_main_a 420 $T $(cat "$R/main_a.txt") &
STEP_TAIL=4 step k_main_b 420 $T $(cat "$R/main_b.txt") &
STEP_TAIL=4 step k_options 420 $T tests/test_kernels_gpu.py -k "options and not triton" &
wait
finish s39b 12
