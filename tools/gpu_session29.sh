#!/usr/bin/env bash
# Twenty-ninth session (nvidia-h200): bf16 params with no f32 master copy, rounded stochastically
# (sr, this tree) or to nearest (rtn: this tree with stochastic_round.apply_updates patched to a
# plain cast by sed), against the f32-master bf16 policy.
#   MODE=quality bash tools/gpu_session29.sh   # gpt-124m, QSTEPS steps each: loss and eval loss
#   MODE=speed   bash tools/gpu_session29.sh   # gpt-1b trainer step, 50 steps each, alternated
# carry [".whl"]
set -u
MODE=${MODE:-quality}
OUT=${OUT:-/tmp/s29_out}; R=/tmp/s29_$MODE; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570} TRAIN_STEPS=50
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
rm -rf /tmp/rtn && mkdir -p /tmp/rtn && cp -r jaxopt_train /tmp/rtn/
sed -i 's/        return stochastic_round_bf16(new, element_bits16(new, p, seed))/        return new.astype(jnp.bfloat16)/' \
  /tmp/rtn/jaxopt_train/stochastic_round.py
grep -c "return new.astype(jnp.bfloat16)" /tmp/rtn/jaxopt_train/stochastic_round.py \
  | sed 's/^/rtn tree patched: /' | tee -a "$R/steps.log"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv | tee -a "$R/steps.log"
RTN="env PYTHONPATH=/tmp/rtn:$PYTHONPATH"
if [ "$MODE" = quality ]; then
  Q="-m jaxopt_train.train.cli --preset gpt-124m --steps ${QSTEPS:-1500} --batch-size 16 --warmup 100 \
    --lr 6e-4 --log-every 100 --eval-every 500 --eval-batches 16 --checkpoint-every 0 --progress lines \
    --overwrite --opt-state-dtype bf16"
  STEP_TAIL=5 step master 170 $PY $Q --precision bf16 --grad-dtype compute --run-dir /tmp/q_master
  STEP_TAIL=5 step pure_sr 170 $PY $Q --precision bf16-pure --run-dir /tmp/q_sr
  STEP_TAIL=5 step pure_rtn 170 $RTN $PY $Q --precision bf16-pure --run-dir /tmp/q_rtn
  for d in master sr rtn; do cp /tmp/q_$d/metrics.jsonl "$R/metrics_$d.jsonl" 2>/dev/null; done
else
  # First: does the trainer's step time grow over a run? (gpt-124m went 0.045 -> 0.092 s/step
  # over 1500 steps in MODE=quality.) GPU clocks, power and utilisation sampled every 2 s; the
  # same run with 10 steps per dispatch tells host-side growth from device-side.
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -l 2 > "$R/smi.csv" 2>&1 &
  SMI=$!
  G="-m jaxopt_train.train.cli --preset gpt-124m --steps ${GSTEPS:-800} --batch-size 16 --warmup 100 \
    --lr 6e-4 --log-every 100 --eval-every 0 --eval-batches 1 --checkpoint-every 0 --progress lines \
    --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute"
  STEP_TAIL=9 step growth_k1 110 $PY $G --run-dir /tmp/g_k1
  STEP_TAIL=9 step growth_k10 110 $PY $G --steps-per-dispatch 10 --run-dir /tmp/g_k10
  kill $SMI
  for i in 1 2; do
    STEP_TAIL=6 step master$i 90 $PY $GPT1B_TRAIN --run-dir /tmp/s_master
    STEP_TAIL=6 step pure_sr$i 90 $PY $GPT1B_TRAIN --precision bf16-pure --run-dir /tmp/s_sr
    [ "$i" = 1 ] && STEP_TAIL=6 step pure_rtn$i 90 $RTN $PY $GPT1B_TRAIN --precision bf16-pure --run-dir /tmp/s_rtn
  done
fi
finish s29_$MODE 12
