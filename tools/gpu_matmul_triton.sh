#!/usr/bin/env bash
# One 2-GPU call: gpt-1b's optimised step with XLA's dot, our Mosaic GPU kernel and our Triton
# kernel in one process (GPU 0: bench train --compare-matmul pallas,triton), and the trainer with
# --matmul triton (GPU 1). Needs jax-triton on PYTHONPATH.
#   bash tools/gpu_matmul_triton.sh   # results in $OUT/mmt.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mmt_out}; R=/tmp/mmt; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-330}
source "$(dirname "$0")/gpu_common.sh"
TRAIN="-m jaxopt_train.train.cli --preset gpt-1b --steps ${TRAIN_STEPS:-40} --batch-size 8 --precision bf16 \
  --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --progress lines --overwrite \
  --grad-dtype compute --opt-state-dtype bf16"
CUDA_VISIBLE_DEVICES=0 step bench_mm ${T_B:-300} $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 8 \
  --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 \
  --compare-matmul pallas,triton --out "$R/gpt1b_mm" & A=$!
CUDA_VISIBLE_DEVICES=1 step train_triton ${T_T:-240} $PY $TRAIN --matmul triton --run-dir /tmp/run_triton & B=$!
wait $A $B
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
for f in "$R"/*.log; do echo "----- $f"; tail -n 30 "$f"; done > "$OUT/summary.txt"
tar czf "$OUT/mmt.tar.gz" -C /tmp mmt
