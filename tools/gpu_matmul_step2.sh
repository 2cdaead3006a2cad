#!/usr/bin/env bash
# Second issue-5 call: the gpt-1b step with XLA's dot and with our kernel, profiled side by side
# (tools/probe_gpt1b.py, one process each, GPU 0), then `bench train --compare-matmul pallas`;
# on GPU 1 the whole GPU kernel test file, then the trainer's step with --matmul pallas and xla.
#   bash tools/gpu_matmul_step2.sh     # results in $OUT/mm2.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/mm2_out}; R=/tmp/mm2; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
TRAIN="-m jaxopt_train.train.cli --preset gpt-1b --steps ${TRAIN_STEPS:-40} --batch-size 8 --precision bf16 \
  --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --progress lines --overwrite \
  --grad-dtype compute --opt-state-dtype bf16"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  for mm in xla pallas; do
    OUT=$R step probe_$mm ${T_P:-110} $PY tools/probe_gpt1b.py --variants opt --matmul $mm --profile --tag _$mm
  done
  step bench_mm ${T_B:-200} $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 8 --microbatches 1 \
    --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --compare-matmul pallas --out "$R/gpt1b_mm"
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step kernel_tests ${T_K:-320} $PY -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider
  step train_pallas ${T_TP:-100} $PY $TRAIN --matmul pallas --run-dir /tmp/run_pallas
  step train_xla ${T_TX:-80} $PY $TRAIN --matmul xla --run-dir /tmp/run_xla
}
lane0 & A=$!
lane1 & B=$!
wait $A $B
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
rm -rf "$R"/trace_*/plugins/profile/*/*.xplane.pb
for f in "$R"/*.log; do echo "----- $f"; tail -n 30 "$f"; done > "$OUT/summary.txt"
tar czf "$OUT/mm2.tar.gz" -C /tmp mm2
