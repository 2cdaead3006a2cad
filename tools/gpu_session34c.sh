#!/usr/bin/env bash
# Thirty-fourth session, call C (~6 min on nvidia-h200): the Triton default tile now fits the
# GPU's shared memory per block (019002b). Triton's own figure for our kernel compiled for
# sm_80/86/89/90 (tools/probe_triton_smem.py: lowering only, nothing runs), then the changed
# kernel tests and the Triton GPU tests on the H200 (whose default must be unchanged).
#   bash tools/gpu_session34c.sh   # carry [".whl"]
set -u
OUT=${OUT:-/tmp/s34c_out}; R=/tmp/s34c; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-500}
source "$(dirname "$0")/gpu_common.sh"
install_whl; export PYTHONPATH=$PYTHONPATH:/tmp/site
export CUDA_VISIBLE_DEVICES=0
export JAX_TRITON_DUMP_DIR=/tmp/jtdump
STEP_TAIL=0 step smem 200 $PY tools/probe_triton_smem.py --json $R/smem.json
unset JAX_TRITON_DUMP_DIR
cat "$R/smem.log" | grep '^{' | $PY -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['cc'], r['block_m'], r['block_n'], r['block_k'], r['num_stages'], r['num_warps'], 'est', r['estimate'], 'triton', r.get('shared', r.get('error')), r['seconds'], 's')
" | tee "$R/smem_table.txt"
STEP_TAIL=4 step t_kernels 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_kernels_checks.py tests/test_kernels.py \
  -k "triton or shared_memory or capability or autotune or default_config"
STEP_TAIL=4 step t_triton_gpu 200 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py -k triton
finish s34c 40
