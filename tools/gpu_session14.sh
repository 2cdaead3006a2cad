#!/usr/bin/env bash
# Fourteenth session, call 2 (nvidia-h200, one GPU; x2 was not lent): call 1's `bench matmul`
# layer table had our kernel's bias+GELU layer, forward + backward, at 0.74x XLA's. First a
# kernel-by-kernel profile of that layer (tools/probe_layer.py), then the kernel GPU tests
# other than Triton and the option sweeps (gpu_all_tests.sh's GPU-0 half) on the changed store path.
#   bash tools/gpu_session14.sh   # results in $OUT/summary.txt, $OUT/layer_probe.json
set -u
OUT=${OUT:-/tmp/s14_out}; R=/tmp/s14; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
OUT=$R step layer 200 $PY tools/probe_layer.py
cp "$R/layer_probe.json" "$OUT/" 2>/dev/null
step k_main 420 $T tests/test_kernels_gpu.py -k "${TESTS_K:-not triton and not options}"
finish s14 40
