#!/usr/bin/env bash
# One device-machine call that checks and times everything GPU-side at once.
#   bash tools/gpu_sweep.sh            # on the 2-GPU machine; results under $OUT
#   SWEEP_DRY=1 bash tools/gpu_sweep.sh  # CPU dry run with tiny models (checks the flags)
# Single-GPU work runs in two lanes, one per GPU, in parallel; then the 2-GPU runs.
# Everything lands in $OUT/sweep/ and is packed into $OUT/sweep.tar.gz (the device tool
# returns at most 8 files).
set -u
OUT=${OUT:-/tmp/sweep_out}; R=$OUT/sweep; mkdir -p "$R"
export JAXOPT_TRAIN_CACHE_DIR=$R STEP_TAIL=40
source "$(dirname "$0")/gpu_common.sh"
if [ "${SWEEP_DRY:-0}" = 1 ]; then
  BIG=gpt-tiny; MID=gpt-tiny; VIS=cnn-small; Q=--quick; TQ="--model d_model=32 --model n_layers=1"
  BIGTRAIN="--preset gpt-tiny --steps 6 --batch-size 8"
else
  BIG=gpt-1b; MID=gpt-124m; VIS=resnet50; Q=; TQ=
  BIGTRAIN="--preset gpt-1b --steps ${TRAIN_STEPS:-40} --batch-size 8"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > "$R/nvidia-smi.txt" 2>&1
nvidia-smi topo -m >> "$R/nvidia-smi.txt" 2>&1
$PY -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())" > "$R/versions.txt" 2>&1
step doctor 60 $PY -m jaxopt_train.runtime.doctor
$PY -m jaxopt_train.runtime.doctor --json > "$R/doctor.json" 2>/dev/null
step monitor 40 $PY -m jaxopt_train.runtime.monitor_demo --seconds 8 --interval 0.25 --load --json "$R/monitor.json"

lane_a() {  # GPU 0: the big single-GPU runs
  export CUDA_VISIBLE_DEVICES=0
  step bench_gpt1b ${T_BIG:-300} $PY -m jaxopt_train.bench.train --model $BIG --global-batch 8 \
    --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 $Q --out "$R/gpt1b"
  step train_gpt1b_xla ${T_TRAIN:-150} $PY -m jaxopt_train.train.cli $BIGTRAIN $TQ --precision bf16 \
    --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --attention auto \
    --progress lines --matmul xla --run-dir /tmp/run_xla --overwrite
  step train_gpt1b_pallas ${T_TRAIN:-150} $PY -m jaxopt_train.train.cli $BIGTRAIN $TQ --precision bf16 \
    --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --attention auto \
    --progress lines --matmul pallas --run-dir /tmp/run_pallas --overwrite
}
lane_b() {  # GPU 1: the smaller single-GPU runs
  export CUDA_VISIBLE_DEVICES=${LANE_B_GPU:-1}
  step bench_resnet50 ${T_VIS:-150} $PY -m jaxopt_train.bench.train --model $VIS --global-batch 256 \
    --steps 30 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --dataset-tokens 1281167 $Q --out "$R/resnet50"
  step bench_tiny_k 90 $PY -m jaxopt_train.bench.train --model gpt-tiny --global-batch 8 --steps 320 \
    --bursts 5 --compare-dispatch 1,16 --xla-preset none $Q --out "$R/tiny_k"
  step bench_accum 150 $PY -m jaxopt_train.bench.accumulation --model $MID --batch 32 --microbatches 4 \
    $Q --json "$R/accumulation.json"
  step gpu_tests 120 $PY -m pytest -q -m gpu tests/test_models.py tests/test_bench_train.py \
    tests/test_doctor.py tests/test_monitor.py tests/test_runtime_memory.py
}
if [ "${SWEEP_DRY:-0}" = 1 ]; then LANE_B_GPU=0; fi
case ${PHASE:-all} in all|1)
  lane_a & A=$!; lane_b & B=$!; wait $A $B
esac
lane_a2() {  # GPU 0: the trainer's own gpt-1b step: scanned vs unrolled layers, xla vs pallas
  export CUDA_VISIBLE_DEVICES=0
  local common="$BIGTRAIN $TQ --precision bf16 --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 \
    --checkpoint-every 0 --progress lines --overwrite"
  step train2_scan 110 $PY -m jaxopt_train.train.cli $common --run-dir /tmp/r1
  step train2_unrolled 110 $PY -m jaxopt_train.train.cli $common --no-scan-layers --run-dir /tmp/r2
  step train2_unrolled_pallas 120 $PY -m jaxopt_train.train.cli $common --no-scan-layers --matmul pallas --run-dir /tmp/r3
}
lane_b2() {
  export CUDA_VISIBLE_DEVICES=${LANE_B_GPU:-1}
  step bench_resnet50 ${T_VIS:-150} $PY -m jaxopt_train.bench.train --model $VIS --global-batch 256 \
    --steps 30 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --dataset-tokens 1281167 $Q --out "$R/resnet50"
}
if [ "${PHASE:-all}" = 2 ]; then
  lane_a2 & A=$!; lane_b2 & B=$!; wait $A $B
fi
lane_a3() {  # GPU 0: bench train with ablations, then the 16 GiB budget
  export CUDA_VISIBLE_DEVICES=0
  step bench_gpt1b ${T_BIG:-300} $PY -m jaxopt_train.bench.train --model $BIG --global-batch 8 \
    --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 \
    --ablate $Q --out "$R/gpt1b"
}
lane_b3_train() {  # GPU 1: the trainer's own gpt-1b step (bf16 grads + state vs not)
  export CUDA_VISIBLE_DEVICES=${LANE_B_GPU:-1}
  local common="$BIGTRAIN $TQ --precision bf16 --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 \
    --checkpoint-every 0 --progress lines --overwrite"
  step train3_bf16gs 110 $PY -m jaxopt_train.train.cli $common --grad-dtype compute \
    --opt-state-dtype bf16 --run-dir /tmp/r1
  step train3_f32gs 110 $PY -m jaxopt_train.train.cli $common --run-dir /tmp/r2
}
lane_b3() {  # GPU 1: the trainer runs, then the 16 GiB budget
  lane_b3_train
  step bench_gpt1b_16g ${T_16G:-170} $PY -m jaxopt_train.bench.train --model $BIG --global-batch 8 \
    --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 \
    --memory-budget 16GiB $Q --out "$R/gpt1b_16g"
}
lane_a4() {  # GPU 0: bench train without ablations (a re-measure after a step change)
  export CUDA_VISIBLE_DEVICES=0
  step bench_gpt1b ${T_BIG:-150} $PY -m jaxopt_train.bench.train --model $BIG --global-batch 8 \
    --microbatches 1 --steps 30 --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 \
    $Q --out "$R/gpt1b"
}
if [ "${PHASE:-all}" = 4 ]; then  # lanes only: re-measure bench + trainer, then the 2-GPU table
  lane_a4 & A=$!; (LANE_B4=1 lane_b3_train) & B=$!; wait $A $B
fi
if [ "${PHASE:-all}" = 3 ]; then
  lane_a3 & A=$!; lane_b3 & B=$!; wait $A $B
  step bench_collectives ${T_COLL:-100} $PY -m jaxopt_train.bench.collectives --sizes 256M,1G,16M \
    --dtypes f32 --chunks 1 --iters 10 --bursts 3 ${COLL_EXTRA:-} $Q --json "$R/collectives.json"
fi
if [ "${PHASE:-all}" != 1 ]; then
  step bench_gpt1b_x2 ${T_X2:-240} $PY -m jaxopt_train.bench.train --model $BIG --global-batch 16 \
    --steps 30 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 $Q --out "$R/gpt1b_x2"
fi
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
tar czf "$OUT/sweep.tar.gz" -C "$OUT" sweep && cp "$R/steps.log" "$OUT/steps.log"
