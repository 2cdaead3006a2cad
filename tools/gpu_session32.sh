#!/usr/bin/env bash
# Thirty-second session (~6 min on nvidia-h200): this session's fixes on a real GPU.
#   t_gpu       every GPU-marked test outside the kernel and two-GPU collectives files
#   t_changed   the changed tests that run on one GPU: the empty-batch skip under a real fp16
#               step (replicated and ZeRO), the warmup note, the docstring examples (NVML and
#               the allocator's statistics are real here), bench train --help, the run dir's
#               --overwrite kinds, --memory-limit's no-GPU note (must stay silent here)
#   smoke       the trainer, gpt-124m for 12 steps under the default warmup of 20: the note
#               must be printed; then --memory-limit 0.5 must not say "no NVIDIA GPU"
#   bash tools/gpu_session32.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s32_out}; R=/tmp/s32; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-540}
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=4 step t_gpu 170 $T -m gpu tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
STEP_TAIL=6 step t_changed 200 $T tests/test_docstring_examples.py tests/test_train_inputs.py tests/test_train_cli.py \
  "tests/test_trainer_models.py::test_a_batch_with_nothing_to_count_is_skipped_without_touching_the_loss_scale" \
  "tests/test_bench_train.py::test_help_states_every_default_including_the_quick_ones"
STEP_TAIL=3 step t_warmup 60 $T tests/test_train.py -k "warmup or optimizer_schedule"
G="-m jaxopt_train.train.cli --preset gpt-124m --steps 12 --batch-size 8 --lr 6e-4 \
  --log-every 6 --eval-every 0 --checkpoint-every 0 --progress lines --precision bf16 --run-dir /tmp/smoke"
STEP_TAIL=8 step smoke 120 $PY $G --overwrite
STEP_TAIL=4 step smoke_cap 120 $PY $G --overwrite --memory-limit 0.5
grep -h "note: warmup\|memory capped" "$R/smoke.log" "$R/smoke_cap.log" | tee -a "$R/steps.log"
finish s32 25
