#!/usr/bin/env bash
# Thirty-first session, call C (~6 min on nvidia-h200): this session's fixes on the GPU.
#   t_gpu       every GPU-marked test outside the kernel and two-GPU collectives files
#   t_changed   the changed modules' test files that run on one GPU (memory, doctor, kernel
#               time, embedding / ids, optimizer state and rounding)
#   smoke       the trainer with the reordered start-up: gpt-124m, 60 steps, a Prometheus port,
#               a --profile-steps trace and --memory-limit 16GiB (the fraction now rounded down),
#               then `jaxopt-train kernels` on that GPU trace (--json, then refused without
#               --overwrite), then an --overwrite rerun with a file where its trace goes: refused,
#               and the first run's checkpoints and metrics must still be there
#   bash tools/gpu_session31c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s31c_out}; R=/tmp/s31c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=4 step t_gpu 150 $T -m gpu tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
STEP_TAIL=4 step t_changed 170 $T tests/test_runtime_memory.py tests/test_doctor.py tests/test_runtime_kernel_time.py \
  tests/test_models_embedding.py tests/test_optim.py tests/test_stochastic_round.py
G="-m jaxopt_train.train.cli --preset gpt-124m --steps 60 --batch-size 16 --warmup 10 --lr 6e-4 \
  --log-every 20 --eval-every 0 --checkpoint-every 30 --progress lines --precision bf16 \
  --opt-state-dtype bf16 --grad-dtype compute --run-dir /tmp/smoke"
STEP_TAIL=12 step smoke 120 $PY $G --prometheus-port 0 --profile-steps 40:43 --memory-limit 16GiB --overwrite
K="$PY -m jaxopt_train.runtime.kernel_time /tmp/smoke/profile --steps 3"
STEP_TAIL=14 step kernels 60 $K --top 8 --json $R/smoke_kernels.json
STEP_TAIL=3 step kernels_again 60 $K --json $R/smoke_kernels.json
ls /tmp/smoke /tmp/smoke/checkpoints > "$R/before.txt" 2>&1; wc -l /tmp/smoke/metrics.jsonl >> "$R/before.txt"
mv /tmp/smoke/profile /tmp/smoke_profile && touch /tmp/smoke/profile
STEP_TAIL=3 step overwrite_refused 60 $PY $G --profile-steps 40:43 --overwrite
ls /tmp/smoke /tmp/smoke/checkpoints > "$R/after.txt" 2>&1; wc -l /tmp/smoke/metrics.jsonl >> "$R/after.txt"
diff "$R/before.txt" "$R/after.txt" > "$R/diff.txt" && echo "run dir unchanged by the refused --overwrite" | tee -a "$R/steps.log" \
  || { echo "RUN DIR CHANGED:" | tee -a "$R/steps.log"; cat "$R/diff.txt" | tee -a "$R/steps.log"; }
finish s31c 25
