#!/usr/bin/env bash
# Prepared in the fourteenth session for the next device call (nvidia-h200-x2, ~9 min; with
# GPUS=0 on nvidia-h200 the two lanes run one after the other, as far as DEADLINE allows).
# GPU 0: the fused MLP's fc layer is 1.021x XLA's and 1.048x the unfused kernel layer
# (tools/probe_layer.py), yet its gpt-1b step was 0.4 ms slower. Profile both steps kernel by
# kernel (probe_gpt1b --profile), then compare them here with
#   python tools/diff_profiles.py $files_at/prof_optfuse.json $files_at/prof_optnofuse.json
# GPU 1: the 26 Triton GPU tests, which the fourteenth session could not run (jax-triton from the
# carried .whl/), then steps per dispatch k = 1 and 4 at the steady state.
# Last, on both GPUs, the collective tests.
#   bash tools/gpu_session15.sh   # carry [".whl"]; results in $OUT/summary.txt, $OUT/prof_*.json
set -u
OUT=${OUT:-/tmp/s15_out}; R=/tmp/s15; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
GPUS=${GPUS:-0 1}
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  local v
  for v in optfuse optnofuse; do
    OUT=$R step "prof_$v" 150 $PY tools/probe_gpt1b.py --variants $v --profile --warmup-s 15 \
      --tag "_prof_$v" --matmul pallas
    cp "$R/gpt1b_probe_prof_$v.json" "$OUT/prof_$v.json" 2>/dev/null
  done
}
lane_b() {  # lane_b GPU
  export CUDA_VISIBLE_DEVICES=$1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1 || echo "=== no .whl/: the Triton tests will skip" | tee -a "$R/steps.log"
  PYTHONPATH=/tmp/site:$PYTHONPATH step k_triton 150 $T tests/test_kernels_gpu.py -k triton
  [ "${DISPATCH:-1}" = 1 ] || return 0  # DISPATCH=0: one GPU's call has no room for it
  STEP_TAIL=14 step dispatch 320 $PY $GPT1B_BENCH --compare-dispatch 1,4 --warmup-s 15 \
    --json "$OUT/dispatch.json"
}
if [ "$GPUS" = "0" ]; then
  lane_a; lane_b 0  # one GPU: what time is left after the profiles (DEADLINE)
else
  lane_a & A=$!; lane_b 1 & B=$!; wait $A $B
  step collectives 60 $T tests/test_collectives_gpu.py
fi
finish s15 20 --exclude=*.trace.json.gz --exclude=hlo_* --exclude=trace_*
