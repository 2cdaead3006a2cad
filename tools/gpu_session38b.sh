#!/usr/bin/env bash
# Thirty-eighth session, call B (~5 min): the session's audits on the GPU. The GPU tests of the
# bench, memory, monitor and doctor; then the trainer end to end on gpt-124m: 20 steps, a resume
# at the last step (says the run is complete, compiles nothing, exit 0, no file touched: the
# files' sizes and mtimes before and after are compared), and a resume to 30 steps.
#   bash tools/gpu_session38b.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s38b_out}; R=/tmp/s38b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > "$R/gpu.txt" 2>&1
STEP_TAIL=4 step t_gpu 240 $PY -m pytest -q -rfE -p no:cacheprovider -m gpu \
  tests/test_bench_train.py tests/test_runtime_memory.py tests/test_monitor.py tests/test_doctor.py
RUN=/tmp/s38b_run
TRAIN="-m jaxopt_train.train.cli --preset gpt-124m --batch-size 8 --precision bf16 --warmup 2 \
  --log-every 10 --eval-every 0 --checkpoint-every 10 --progress lines --run-dir $RUN"
STEP_TAIL=6 step train20 150 $PY $TRAIN --steps 20
files() { find $RUN -type f -printf "%p %s %T@\n" | sort; }  # files, sizes, mtimes
files > "$R/before.txt" 2>&1
STEP_TAIL=6 step resume_done 90 $PY $TRAIN --steps 20 --resume
files > "$R/after.txt" 2>&1
if cmp -s "$R/before.txt" "$R/after.txt"; then echo "run dir unchanged by the complete resume" | tee -a "$R/steps.log"
else echo "run dir CHANGED by the complete resume" | tee -a "$R/steps.log"; diff "$R/before.txt" "$R/after.txt" >> "$R/steps.log"; fi
STEP_TAIL=6 step resume30 120 $PY $TRAIN --steps 30 --resume
finish s38b 12
