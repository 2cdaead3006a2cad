#!/usr/bin/env bash
# Fourteenth session, call 3 (nvidia-h200, one GPU, ~9 min). Call 2's layer profile found
# `bench matmul`'s `+saved` row running the recomputing path (fixed), and the kept-Z backward
# splitting dZ and its column sum into two passes with dZ in f32 between them; the activation's
# derivative is now taken in Z's dtype. This call: (1) the layer profile again, both ways
# (tools/probe_layer.py); (2) the gpt-1b step, fused MLP against unfused, then XLA's
# (15 s warm-up each); (3) GPU tests not yet run on this tree: the kept-Z gradient test, the
# kernel option sweeps, and the other modules' GPU tests, as far as the time allows.
#   bash tools/gpu_session14b.sh   # results in $OUT/summary.txt, $OUT/rows.txt, $OUT/layer_probe.json
# As run (commit 9d0ca90) the probe's default variants included the f32-derivative row; that
# switch is gone since, so a rerun profiles the four others.
set -u
OUT=${OUT:-/tmp/s14b_out}; R=/tmp/s14b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
OUT=$R step layer 110 $PY tools/probe_layer.py
cp "$R/layer_probe.json" "$OUT/" 2>/dev/null
for spec in "pallas optfuse,optnofuse" "xla opt"; do
  set -- $spec
  OUT=$R step "probe_$1" 180 $PY tools/probe_gpt1b.py --variants "$2" --warmup-s 15 --tag "_$1" --matmul "$1"
done
step tests 300 $T tests/test_kernels_gpu.py -k "saved_preactivation_gradients or options"
step others 90 $T tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
finish s14b 40 --exclude=hlo_* --exclude=trace_*
grep -h '^\[probe\] {' "$R"/probe_*.log > "$OUT/rows.txt"
