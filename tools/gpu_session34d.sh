#!/usr/bin/env bash
# Thirty-fourth session, call D (~5 min on nvidia-h200): the non-Hopper fixes must leave the
# H200 as it was. What attention "auto" resolves to here, every GPU-marked test outside the
# kernel and two-GPU files, the changed attention/MFU tests, and the gpt-1b trainer (cuDNN
# attention: 0.088-0.090 s/step, 20.42 GiB in call A).
#   bash tools/gpu_session34d.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s34d_out}; R=/tmp/s34d; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=6 step resolve 60 $PY -c "
from jaxopt_train.models.gpt import cudnn_attention_unavailable
from jaxopt_train.bench.train_steps import optimised_attention
from jaxopt_train.train.task import _prefer_cudnn_attention
from jaxopt_train.models import get_gpt_config
import jax
print('devices', jax.devices(), [d.compute_capability for d in jax.local_devices()])
print('cudnn unavailable:', cudnn_attention_unavailable())
print('bench optimised auto ->', optimised_attention('auto'))
print('trainer gpt-1b bf16 auto ->', _prefer_cudnn_attention(get_gpt_config('gpt-1b', dtype='bf16')).attention)
"
STEP_TAIL=4 step t_gpu 150 $PY -m pytest -q -rfE -p no:cacheprovider -m gpu tests \
  --ignore=tests/test_kernels_gpu.py --ignore=tests/test_collectives_gpu.py
STEP_TAIL=4 step t_changed 120 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_train_inputs.py \
  tests/test_models_edges.py tests/test_mfu.py tests/test_collectives_bench.py -k "attention or cudnn or peak or nvlink"
STEP_TAIL=6 step b1_xla 90 $PY ${GPT1B_TRAIN/--steps 40/--steps 30} --matmul xla --run-dir /tmp/b1_xla
finish s34d 20
