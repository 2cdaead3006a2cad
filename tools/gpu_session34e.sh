#!/usr/bin/env bash
# Thirty-fourth session, call E (~2 min on nvidia-h200): the doctor's new fast-paths line on a
# real GPU, and tests/test_doctor.py there (fake and real NVML).
#   bash tools/gpu_session34e.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s34e_out}; R=/tmp/s34e; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-200}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
STEP_TAIL=40 step doctor 60 $PY -m jaxopt_train.runtime.doctor
STEP_TAIL=4 step t_doctor 100 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_doctor.py
finish s34e 40
