#!/usr/bin/env bash
# One 2-GPU call after the Triton kernel learnt strided (transposed) operands: its GPU tests
# (GPU 1) and gpt-1b's optimised step with XLA's dot vs the Triton kernel (GPU 0).
#   bash tools/gpu_triton_bwd.sh   # results in $OUT/tb.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/tb_out}; R=/tmp/tb; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-260}
source "$(dirname "$0")/gpu_common.sh"
CUDA_VISIBLE_DEVICES=0 step bench_mm ${T_B:-250} $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 8 \
  --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 \
  --compare-matmul triton --out "$R/gpt1b_mm" & A=$!
CUDA_VISIBLE_DEVICES=1 step triton_tests ${T_K:-200} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py \
  -k "triton or transpose" -p no:cacheprovider & B=$!
wait $A $B
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
for f in "$R"/*.log; do echo "----- $f"; tail -n 30 "$f"; done > "$OUT/summary.txt"
tar czf "$OUT/tb.tar.gz" -C /tmp tb
