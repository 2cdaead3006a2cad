#!/usr/bin/env bash
# Thirty-third session, call A (~8 min on nvidia-h200): this session's fixes on a real GPU.
#   t_gpu       every GPU-marked test outside the kernel and two-GPU collectives files
#   t_changed   the changed tests that run on one GPU: NNX outputs in the policy's output dtype
#               under a real fp16 step, float16 master weights refused, the GPT loss at huge
#               logits, the autotune cache's error paths, the precision suite
#   b1_old / b1_new   gpt-1b trainer, --matmul xla, on the tree before this session's
#               cross-entropy change (OLD_TAR) and on this one: step time, MFU, memory, loss
#   b1_pallas   the same on this tree with --matmul pallas (issue 5's <= 3% slower target)
#   OLD_TAR=.whl/old.tar bash tools/gpu_session33.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s33_out}; R=/tmp/s33; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-560} TRAIN_STEPS=${TRAIN_STEPS:-40}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0 JAX_COMPILATION_CACHE_DIR=/tmp/jcache
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$R/gpu.txt" 2>&1
T="$PY -m pytest -q -rfE -p no:cacheprovider"
STEP_TAIL=4 step t_gpu 150 $T -m gpu tests --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
STEP_TAIL=6 step t_changed 150 $T tests/test_autotune_cache_errors.py tests/test_precision.py \
  tests/test_trainer_models.py "tests/test_models.py::test_gpt_loss_keeps_its_precision_at_huge_logits" \
  "tests/test_models.py::test_gpt_loss_gradient_matches_autodiff_of_the_reference"
mkdir -p /tmp/old && tar -xf "${OLD_TAR:-.whl/old.tar}" -C /tmp/old
(cd /tmp/old && export PYTHONPATH=/tmp/old:/tmp/site && STEP_TAIL=6 step b1_old 110 $PY $GPT1B_TRAIN --run-dir /tmp/b1_old)
STEP_TAIL=6 step b1_new 110 $PY $GPT1B_TRAIN --run-dir /tmp/b1_new
STEP_TAIL=6 step b1_pallas 120 $PY $GPT1B_TRAIN --matmul pallas --run-dir /tmp/b1_pallas
finish s33 20
