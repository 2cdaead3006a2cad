#!/usr/bin/env bash
# Every GPU-marked test except the Triton kernel tests (those ran in call 1 of the eighteenth
# session: 52 passed), on ONE GPU (~8 min on nvidia-h200): tools/gpu_all_tests.sh needs two.
# The kernel tests are correctness checks, not timings, so three pytest processes share GPU 0
# (allocator not preallocated) to spread compilation over the host's cores:
#   main tests split in two by node id, the option sweeps, then the other modules' GPU tests.
#   bash tools/gpu_session18b.sh   # carry [".whl"] so jax-triton imports where a test wants it
# TRITON=1 adds the Triton kernel tests as a fourth process (~190 s; nineteenth session).
# OTHERS_FIRST=1 runs the other modules' GPU tests before the kernel tests (limit $OTHERS_S,
# default 90 s), so the deadline cannot cut them (thirty-ninth session: OTHERS_S=150).
# OTHERS_PARALLEL=1 runs them beside the kernel tests instead, and MAIN_PARTS=N (default 2)
# splits the main kernel tests N ways: the forty-seventh session's pass on one H100 took 540 s
# with others first (235 s) and the main halves cut at 289 s, then 174 s for the 44 left in three
# processes; all at once, in three parts, should fit one call (not yet measured):
#   OTHERS_PARALLEL=1 OTHERS_S=400 MAIN_PARTS=3 TRITON=1 bash tools/gpu_session18b.sh
# First it prints XLA_FLAGS as tests/conftest.py leaves them: no CPU -O0 flag on a GPU machine.
set -u
OUT=${OUT:-/tmp/s18b_out}; R=/tmp/s18b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
parts_ok "${MAIN_PARTS:-2}" || exit 2  # before any test runs
install_whl
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
export PYTHONPATH=/tmp/site:$PYTHONPATH CUDA_VISIBLE_DEVICES=0
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
$T --collect-only tests/test_kernels_gpu.py -k "not triton and not options" 2>/dev/null \
  | grep '::' > "$R/main_ids.txt"
echo "main tests: $(wc -l < "$R/main_ids.txt")" | tee -a "$R/steps.log"
$PY -c "import os, runpy; runpy.run_path('tests/conftest.py'); print('conftest XLA_FLAGS:', repr(os.environ.get('XLA_FLAGS')))" \
  2>&1 | tail -1 | tee -a "$R/steps.log"
others() { STEP_TAIL=6 step others "${OTHERS_S:-90}" $T tests --ignore=tests/test_kernels_gpu.py; }
if [ "${OTHERS_FIRST:-0}" = 1 ]; then others; elif [ "${OTHERS_PARALLEL:-0}" = 1 ]; then others & fi
if [ "${TRITON:-0}" = 1 ]; then STEP_TAIL=4 step k_triton 500 $T tests/test_kernels_gpu.py -k triton & fi
# part a gets ids 1, 1+N, ...: with N = 2 the halves as before (logs k_main_a, k_main_b)
run_id_parts k_main "$R/main_ids.txt" "${MAIN_PARTS:-2}" 500 || exit 2
STEP_TAIL=4 step k_options 500 $T tests/test_kernels_gpu.py -k "options and not triton" &
wait
if [ "${OTHERS_FIRST:-0}" != 1 ] && [ "${OTHERS_PARALLEL:-0}" != 1 ]; then others; fi
finish s18b 12
