#!/usr/bin/env bash
# Twenty-eighth session, call D (~3.5 min on nvidia-h200): the gpt-1b trainer step with its bf16
# AdamW moments rounded stochastically (sr, this tree) against rounded to nearest (rtn: the same
# tree with low_precision_state's rounding switched off by sed), alternated, 50 steps each, so
# the power-capped clocks drift across both alike. Prints the per-10-step s/step and MFU lines.
#   bash tools/gpu_session28c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s28c_out}; R=/tmp/s28c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-300} TRAIN_STEPS=50
source "$(dirname "$0")/gpu_common.sh"
export CUDA_VISIBLE_DEVICES=0
rm -rf /tmp/rtn && mkdir -p /tmp/rtn && cp -r jaxopt_train /tmp/rtn/
sed -i 's/_narrow(wide, dtype, seed, state)/_narrow(wide, dtype)/' /tmp/rtn/jaxopt_train/train/optim.py
grep -c "_narrow(wide, dtype)," /tmp/rtn/jaxopt_train/train/optim.py | sed 's/^/rtn tree patched: /' | tee -a "$R/steps.log"
for i in 1 2; do
  STEP_TAIL=6 step sr$i 75 $PY $GPT1B_TRAIN --run-dir /tmp/s28c_sr
  STEP_TAIL=6 step rtn$i 75 env PYTHONPATH=/tmp/rtn:$PYTHONPATH $PY $GPT1B_TRAIN --run-dir /tmp/s28c_rtn
done
finish s28c 12
