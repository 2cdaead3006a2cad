#!/usr/bin/env bash
# Fifteenth session, call 2 (nvidia-h200, one GPU, ~9 min). Call 1 (tools/gpu_session15.sh) found
# the fused MLP step's extra time in two places: the Mosaic GPU launches (+1.41 ms/step, i.e.
# the fused forward's epilogue) and the kept-Z derivative pass, 286 us a layer in the step
# against 183 us in tools/probe_layer.py and 189 us for XLA's own GELU backward. This call
# keeps what call 1 dropped, the optimised HLO of both steps and of the layer probe, and lists
# the launches of those kernels with their grids (tools/trace_kernels.py); then, as time
# allows, steps per dispatch k = 1, 4 at the steady state.
#   bash tools/gpu_session15b.sh   # results in $OUT/summary.txt, $OUT/hlo.tar.gz, $OUT/kernels.txt
set -u
OUT=${OUT:-/tmp/s15b_out}; R=/tmp/s15b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
for v in optfuse optnofuse; do
  OUT=$R step "prof_$v" 150 $PY tools/probe_gpt1b.py --variants $v --profile --warmup-s 15 \
    --tag "_$v" --matmul pallas
  $PY tools/trace_kernels.py "$R/trace_${v}_$v" 'mosaic|add_reduce|convert_multiply' > "$R/kernels_$v.txt" 2>&1
done
OUT=$R step layer 110 $PY tools/probe_layer.py --variants mosaic_gpu+saved,mosaic_gpu+xla_gelu
(cd "$R" && tar czf "$OUT/hlo.tar.gz" hlo_*.txt)
for f in "$R"/kernels_*.txt; do echo "----- $f"; cat "$f"; done > "$OUT/kernels.txt"
cp "$R"/gpt1b_probe_*.json "$R/layer_probe.json" "$OUT/" 2>/dev/null
STEP_TAIL=14 step dispatch 320 $PY $GPT1B_BENCH --compare-dispatch 1,4 --warmup-s 15 \
  --json "$OUT/dispatch.json"
finish s15b 20 --exclude=*.trace.json.gz --exclude=hlo_* --exclude=trace_*
