#!/usr/bin/env bash
# Thirtieth session, call A (~8 min on nvidia-h200): why the trainer's gpt-124m step grows
# 0.038 -> 0.080 s over 800 steps (twenty-ninth session, calls B-D). Four runs of the same command:
#   g_early / g_late  the growing run, traced at steps 100-102 and 650-652 (`jaxopt-train kernels`
#                     sums GPU kernel time by name in each; --against names the kernels that grew.
#                     The call ran with its first form, tools/xplane_kernels.py of commit cfb86eb,
#                     whose JSON is in benchmarks/session30/callA)
#   g_lr0             --lr 1e-30: the same program, the weights (and loss) do not move. Flat means
#                     the growth follows the values; growing means it follows time or step count
#   g_xla             --attention xla instead of cuDNN's fused attention
# nvidia-smi logs power, clocks (SM and memory), temperatures and throttle reasons every second.
#   bash tools/gpu_session30.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s30_out}; R=/tmp/s30; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,temperature.memory,utilization.gpu,utilization.memory,clocks_event_reasons.active \
  --format=csv -l 1 > "$R/smi.csv" 2>&1 &
SMI=$!
S=${GSTEPS:-700}
G="-m jaxopt_train.train.cli --preset gpt-124m --steps $S --batch-size 16 --warmup 100 \
  --log-every 50 --eval-every 0 --eval-batches 1 --checkpoint-every 0 --progress lines \
  --overwrite --opt-state-dtype bf16 --precision bf16 --grad-dtype compute"
STEP_TAIL=16 step g_early 150 $PY $G --lr 6e-4 --profile-steps 100:103 --run-dir /tmp/g_early
K="$PY -m jaxopt_train.runtime.kernel_time"
$K /tmp/g_early/profile --steps 3 --json "$R/early.json" > "$R/k_early.log" 2>&1
STEP_TAIL=16 step g_late 150 $PY $G --lr 6e-4 --profile-steps 650:653 --run-dir /tmp/g_late
$K /tmp/g_late/profile --steps 3 --json "$R/late.json" > "$R/k_late.log" 2>&1
$K /tmp/g_early/profile --against /tmp/g_late/profile --steps 3 --top 30 > "$R/k_diff.log" 2>&1
cat "$R/k_diff.log"
STEP_TAIL=16 step g_lr0 150 $PY $G --lr 1e-30 --run-dir /tmp/g_lr0
STEP_TAIL=16 step g_xla 150 $PY $G --lr 6e-4 --attention xla --run-dir /tmp/g_xla
kill $SMI
finish s30 40
