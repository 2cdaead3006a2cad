#!/usr/bin/env bash
# Seventeenth session, call 5 (~8 min on nvidia-h200): Triton's two-output epilogue (new: act(Z)
# and Z from one launch, as the Mosaic GPU kernel does).
# 1. The GPU tests of kept Z (Triton's new ones, and the gradient tests on both kernels), and
#    Triton's fused epilogue.
# 2. gpt-1b's optimised step with --matmul triton, the MLP unfused against fused (probe
#    variants optnofuse, optfuse; one process): should the default fuse on Triton as on Mosaic GPU?
#   bash tools/gpu_session17c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s17c_out}; R=/tmp/s17c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-520}
source "$(dirname "$0")/gpu_common.sh"
install_whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
STEP_TAIL=15 step k_keptz 200 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "(preactivation and not mosaic_kernel) or (triton and fused_epilogue)"
STEP_TAIL=12 OUT=$R step probe_triton 280 $PY tools/probe_gpt1b.py --variants optnofuse,optfuse \
  --warmup-s 10 --tag _triton --matmul triton
cp "$R/gpt1b_probe_triton.json" "$OUT/" 2>/dev/null
finish s17c 25
