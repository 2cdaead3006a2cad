#!/usr/bin/env bash
# Prepared in the sixteenth session for the next device call (~9 min on nvidia-h200; with
# nvidia-h200-x2 the lanes run side by side).
# Lane A (GPU 0): what are the optimised gpt-1b step's ~23 ms of non-matmul kernels? The
# fifteenth session's profile names them (input_add_reduce_fusion 3.5 ms in 16 calls, ...)
# but its HLO dump was too large to bring back. Profile the bench's step (XLA's dot, then our
# kernel with the fused MLP) with an HLO dump, and extract the costliest fusions' HLO on the
# device (tools/extract_fusions.py): $OUT/fusions_xla.txt, $OUT/fusions_pallas.txt.
# Lane B (GPU 1, or GPU 0 after lane A): the issue-5 table with this session's defaults (the
# small-grid rule and the TMA-edge padding), no cache: bench matmul over the four large shapes
# and the small / odd ones, Triton beside it; then the small shapes again with 4 launches per
# dispatch (bench matmul --launches-per-dispatch, new), so their ratios compare kernels.
#   bash tools/gpu_session17.sh   # carry [".whl"]; GPUS=0 on one GPU
# On one GPU the two lanes do not fit one call: LANES=a B_PARTS=epi, then LANES=b B_PARTS="mm small".
set -u
OUT=${OUT:-/tmp/s17_out}; R=/tmp/s17; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
GPUS=${GPUS:-0 1}; LANES=${LANES:-a b}; B_PARTS=${B_PARTS:-epi mm small}
has() { case " $1 " in *" $2 "*) return 0;; esac; return 1; }
lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  local tag matmul
  for tag in ${A_TAGS:-xla pallas}; do
    matmul=(); [ "$tag" = pallas ] && matmul=(--matmul pallas)
    OUT=$R step "prof_$tag" 150 $PY tools/probe_gpt1b.py --variants opt --profile --warmup-s 10 \
      --tag "_$tag" "${matmul[@]}" \
      --xla-extra "--xla_dump_to=$R/dump_$tag --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_per_device"
    $PY tools/extract_fusions.py "$R/gpt1b_probe_$tag.json" "$R/dump_$tag" --top ${A_TOP:-18} --lines ${A_LINES:-40} \
      > "$OUT/fusions_$tag.txt" 2>&1
    cp "$R/gpt1b_probe_$tag.json" "$OUT/prof_$tag.json" 2>/dev/null
  done
}
lane_b() {  # lane_b GPU
  export CUDA_VISIBLE_DEVICES=$1 JAXOPT_TRAIN_CACHE_DIR=$R/nocache
  install_whl
  # The 40 Mosaic GPU fused-epilogue tests did not run on the TMA-edge wrapper (sixteenth session).
  has "$B_PARTS" epi && step k_epilogue 120 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused_epilogue and mosaic"
  has "$B_PARTS" mm && STEP_TAIL=40 PYTHONPATH=/tmp/site:$PYTHONPATH step mm 240 $PY -m jaxopt_train.bench.matmul \
    --backends mosaic_gpu,triton --warmup-s 4 --no-layer --json "$OUT/mm.json"
  # Small shapes with 4 launches per dispatch: kernel time, not the host's (sixteenth session:
  # XLA's 1024^3 measured 56 us and 38 us a call in two calls; its kernel alone is ~10 us).
  has "$B_PARTS" small && STEP_TAIL=20 step mm_small4 100 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
    --warmup-s 3 --no-fused --no-layer --launches-per-dispatch 4 --json "$OUT/mm_small4.json" \
    --shapes 1024x1024x1024,2048x512x2048,1000x777x513,3000x5000x1000,2048x1024x2048,1024x1024x4096,768x768x3072
}
if [ "$GPUS" = "0" ]; then
  has "$LANES" a && lane_a; has "$LANES" b && lane_b 0
else
  lane_a & A=$!; lane_b 1 & B=$!; wait $A $B
fi
finish s17 20 --exclude=dump_* --exclude=*.trace.json.gz --exclude=trace_*
