#!/usr/bin/env bash
# Thirteenth session, call 4 (nvidia-h200-x2; GPUS=0 on nvidia-h200): the MLP's fc + bias + GELU
# fused into our kernel's epilogue, which also writes the pre-activation for the backward
# (matmul(save_preactivation=True), GPTConfig.fuse_mlp_activation). First the GPU tests it touches;
# then the optimised gpt-1b step, 15 s warm-up each: XLA's dot, our kernel fused (`optfuse`), our
# kernel with XLA applying the GELU as before (`optnofuse`); lane 0 in that order, lane 1 reversed.
# As run (commit e675219) the fused MLP was GPTConfig's default, so that call's `opt` was the
# fused step; it is off by default since, and the lanes below name it `optfuse`.
#   [GPUS=0] bash tools/gpu_session13b.sh   # results in $OUT/summary.txt, $OUT/rows.txt
# After call 4, lane 0 also got `bench matmul`'s forward + backward table of the fc layer.
# To re-measure after a change (e.g. the bias-gradient fix that landed after call 5), with only
# the saved-pre-activation tests first:
#   TESTS_K=preactivation bash tools/gpu_session13b.sh
set -u
OUT=${OUT:-/tmp/s13b_out}; R=/tmp/s13b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
GPUS=${GPUS:-0 1}
T="$PY -m pytest -q -rfE -m gpu -p no:cacheprovider"
tests() {
  CUDA_VISIBLE_DEVICES=0 step tests 240 $T tests/test_kernels_gpu.py \
    -k "${TESTS_K:-preactivation or fused_epilogue or gradients or several_tiles or tied_head}"
}
probe() {  # probe GPU TAG MATMUL VARIANTS
  CUDA_VISIBLE_DEVICES=$1 OUT=$R step "probe_$2" ${T_P:-170} $PY tools/probe_gpt1b.py \
    --variants "$4" --warmup-s 15 --tag "_$2" --matmul "$3"
}
lane_a() { probe 0 g0a_xla xla opt; probe 0 g0b_pallas pallas optfuse,optnofuse; layer 0; }
layer() {  # layer GPU: bench matmul's forward + backward table of the fc layer (added after call 4)
  CUDA_VISIBLE_DEVICES=$1 step layer_g$1 120 $PY -m jaxopt_train.bench.matmul --backends mosaic_gpu \
    --no-plain --no-fused --warmup-s 8 --json "$OUT/layer_g$1.json"
}
lane_b() { probe 1 g1a_pallas pallas optnofuse,optfuse; probe 1 g1b_xla xla opt; }
if [ "$GPUS" = "0" ]; then
  tests; lane_a
else
  tests & A=$!; lane_b & B=$!; wait $A; lane_a; wait $B
fi
finish s13b 14 --exclude=*.trace.json.gz --exclude=hlo_*
grep -h '^\[probe\] {' "$R"/probe_*.log > "$OUT/rows.txt"
