#!/usr/bin/env bash
# One 2-GPU device call for issue 5's step-level checks and the bf16-wire pipelining:
#   collectives first (both GPUs): the bf16-wire exchange in 1/2/4/8 pipelined pieces, with and
#     without the gpu-throughput preset (latency-hiding scheduler);
#   lane GPU 0: `bench train --compare-matmul pallas` (gpt-1b optimised step, XLA's dot vs our
#     Mosaic GPU kernel, same process), then a profile of the Pallas step (tools/probe_gpt1b.py);
#   lane GPU 1: the GPU kernel tests, then the trainer's gpt-1b step with --matmul pallas and xla.
#   bash tools/gpu_matmul_step.sh      # results in $OUT/mm.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mm_out}; R=/tmp/mm; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
PRESET=$($PY -c "from jaxopt_train.runtime.xla_flags import format_xla_flags, preset_flags; print(format_xla_flags(preset_flags('gpu-throughput')))")
COLL="-m jaxopt_train.bench.collectives --sizes ${SIZES:-1G,256M} --dtypes f32 --chunks ${CHUNKS:-1,2,4,8} \
  --iters 10 --bursts 3 --methods ring_wire_bf16"
XLA_FLAGS="$PRESET" step coll_wire_preset ${T_C:-70} $PY $COLL --json "$R/coll_wire_preset.json"
step coll_wire_default ${T_C:-70} $PY $COLL --json "$R/coll_wire_default.json"

TRAIN="-m jaxopt_train.train.cli --preset gpt-1b --steps ${TRAIN_STEPS:-40} --batch-size 8 --precision bf16 \
  --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --progress lines --overwrite \
  --grad-dtype compute --opt-state-dtype bf16"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  step bench_mm ${T_B:-240} $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 8 --microbatches 1 \
    --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --compare-matmul pallas --out "$R/gpt1b_mm"
  OUT=$R step probe_pallas ${T_P:-150} $PY tools/probe_gpt1b.py --variants opt --matmul pallas --profile --tag _pallas
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step kernel_tests ${T_K:-200} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider
  step train_pallas ${T_TP:-180} $PY $TRAIN --matmul pallas --run-dir /tmp/run_pallas
  step train_xla ${T_TX:-80} $PY $TRAIN --matmul xla --run-dir /tmp/run_xla
}
lane0 & A=$!
lane1 & B=$!
wait $A $B
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
for f in "$R"/*.log; do echo "----- $f"; tail -n 30 "$f"; done > "$OUT/summary.txt"
tar czf "$OUT/mm.tar.gz" -C /tmp mm
