#!/usr/bin/env bash
# Fifteenth session, call 4 (nvidia-h200, one GPU, ~7 min), on the library's new fused-MLP
# backward (kernels.matmul._epilogue_backward: GELU's derivative through the sigmoid in f32,
# then dZ and its column sum in two passes; call 3 measured it at 132 + 43 us a layer against
# 219 us). (1) The gpt-1b step with `--matmul pallas`, fused and unfused alternately in one
# process (15 s warm-up each), then XLA's dot; (2) the GPU gradient tests of the kept Z.
#   bash tools/gpu_session15d.sh   # results in $OUT/summary.txt, $OUT/gpt1b_probe_ab.json
set -u
OUT=${OUT:-/tmp/s15d_out}; R=/tmp/s15d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
OUT=$R step ab 300 $PY tools/probe_gpt1b.py --variants optfuse,optnofuse,optfuse,optnofuse \
  --warmup-s 15 --tag _ab --matmul pallas --budget-s 400
OUT=$R step xla 80 $PY tools/probe_gpt1b.py --variants opt --warmup-s 15 --tag _xla
step tests 120 $T tests/test_kernels_gpu.py -k "saved_preactivation or writes_activation"
cp "$R"/gpt1b_probe_*.json "$OUT/" 2>/dev/null
finish s15d 14 --exclude=*.trace.json.gz --exclude=hlo_* --exclude=trace_*
