#!/usr/bin/env bash
# Fifteenth session, call 3 (nvidia-h200, one GPU, ~7 min). Call 2 (tools/gpu_session15b.sh):
# in the gpt-1b step the fused MLP saves XLA's GELU forward pass (125 us a layer) and costs
# ~18 us in the kernel's epilogue, but its backward pass (dZ and its column sum, 219 us) is
# ~96 us slower than XLA's own GELU backward (123 us), so the two steps tie (89.44 ms each).
# This call profiles the fused step with the backward formulated three other ways
# (tools/probe_gpt1b.py --epilogue-bwd) and lists the backward's kernels for each, then the
# unfused step as the same-call control.
# As run (commit c88e049) the second spec was called `split`; its files carry that tag.
#   bash tools/gpu_session15c.sh   # results in $OUT/summary.txt, $OUT/kernels.txt, $OUT/*.json
set -u
OUT=${OUT:-/tmp/s15c_out}; R=/tmp/s15c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
for spec in sigmoid tanh+split sigmoid+split nofuse; do
  tag=${spec/+/_}
  if [ "$spec" = nofuse ]; then v=optnofuse; bwd=(); else v=optfuse; bwd=(--epilogue-bwd "$spec"); fi
  OUT=$R step "prof_$tag" 150 $PY tools/probe_gpt1b.py --variants $v --profile --warmup-s 15 \
    --tag "_$tag" --matmul pallas "${bwd[@]}"
  $PY tools/trace_kernels.py "$R/trace_${v}_$tag" 'mosaic|reduce|convert|multiply|loop' > "$R/kernels_$tag.txt" 2>&1
done
for f in "$R"/kernels_*.txt; do echo "----- $f"; head -14 "$f"; done > "$OUT/kernels.txt"
cp "$R"/gpt1b_probe_*.json "$OUT/" 2>/dev/null
finish s15c 12 --exclude=*.trace.json.gz --exclude=hlo_* --exclude=trace_*
