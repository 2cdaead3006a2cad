#!/usr/bin/env bash
# Issue 5's step-level checks on the 2-GPU machine, one device call per PART:
#   PART=1: the bf16-wire exchange in 1/2/4/8 pipelined pieces (both GPUs, with and without the
#           gpu-throughput preset); then lane GPU 0: `bench train --compare-matmul pallas` and a
#           profile of the Pallas step;
#   PART=2: lane GPU 0: the step with XLA's dot and with our kernel profiled side by side
#           (tools/probe_gpt1b.py), then `bench train --compare-matmul pallas`;
#   both:   lane GPU 1: the whole GPU kernel test file, then the trainer with --matmul pallas, xla.
#   PART=2 bash tools/gpu_matmul_step.sh    # results in $OUT/mm.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mm_out}; R=/tmp/mm; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
PART=${PART:-2}
probe() { OUT=$R step probe_$1 ${T_P:-150} $PY tools/probe_gpt1b.py --variants opt --matmul $1 --profile --tag _$1; }
bench_mm() { step bench_mm ${T_B:-240} $PY $GPT1B_BENCH --compare-matmul pallas --out "$R/gpt1b_mm"; }
if [ "$PART" = 1 ]; then
  PRESET=$($PY -c "from jaxopt_train.runtime.xla_flags import format_xla_flags, preset_flags; print(format_xla_flags(preset_flags('gpu-throughput')))")
  COLL="-m jaxopt_train.bench.collectives --sizes ${SIZES:-1G,256M} --dtypes f32 --chunks ${CHUNKS:-1,2,4,8} \
    --iters 10 --bursts 3 --methods ring_wire_bf16"
  XLA_FLAGS="$PRESET" step coll_wire_preset ${T_C:-70} $PY $COLL --json "$R/coll_wire_preset.json"
  step coll_wire_default ${T_C:-70} $PY $COLL --json "$R/coll_wire_default.json"
  lane0() { export CUDA_VISIBLE_DEVICES=0; bench_mm; probe pallas; }
else
  lane0() { export CUDA_VISIBLE_DEVICES=0; probe xla; probe pallas; bench_mm; }
fi
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step kernel_tests ${T_K:-320} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider
  step train_pallas ${T_TP:-180} $PY $GPT1B_TRAIN --matmul pallas --run-dir /tmp/run_pallas
  step train_xla ${T_TX:-80} $PY $GPT1B_TRAIN --matmul xla --run-dir /tmp/run_xla
}
lane0 & A=$!
lane1 & B=$!
wait $A $B
rm -rf "$R"/trace_*/plugins/profile/*/*.xplane.pb
finish mm
