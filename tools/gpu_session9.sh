#!/usr/bin/env bash
# Ninth session, call 1 (nvidia-h200-x2, <= 9.5 min, carry [".whl"]).
#   GPU 0:     gpt-1b's default step (tools/probe_gpt1b.py optcopy) with the eighth session's
#              cross-entropy / embedding NaN guards in the model (86.2 ms before them);
#   GPU 1:     the GPU tests of the modules that session's bad-input sweep touched (one GPU each);
#   both:      tests/test_collectives_gpu.py (bit-identical bf16 wire on the pair);
#   both:      issue 4's bf16-wire exchange vs psum (tools/probe_wire.py, lib only) under
#              default NCCL settings, then with XLA's NCCL user buffers
#              (--xla_gpu_enable_nccl_user_buffers: buffers from ncclMemAlloc, registered with
#              the communicator, so send/recv can write straight into the peer's buffer instead
#              of staging through NCCL's FIFO). One process per setting: flags are read once.
#   both:      bench collectives' f32 ring / bf16-wire rows under user buffers, then gpt-1b's
#              2-GPU bench train under user buffers, as far as the deadline allows.
#   bash tools/gpu_session9.sh   # results in $OUT/s9.tar.gz and $OUT/summary.txt
set -u
OUT=${OUT:-/tmp/s9_out}; R=/tmp/s9; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-555}
source "$(dirname "$0")/gpu_common.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$R/smi.log" 2>&1
UB="--xla_gpu_enable_nccl_user_buffers=true"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$R step probe 150 $PY tools/probe_gpt1b.py --variants optcopy --tag _guards
) & A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step tests1 150 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_models.py \
    tests/test_bench_train.py tests/test_doctor.py tests/test_monitor.py tests/test_runtime_memory.py
) & B=$!
wait $A $B
step tests2 70 $PY -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_collectives_gpu.py
OUT=$R step wire_default 60 $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3 --variants lib
mv "$R/wire_probe.json" "$R/wire_default.json" 2>/dev/null
XLA_FLAGS=$UB OUT=$R step wire_ub 60 $PY tools/probe_wire.py --sizes 256M,1G --iters 10 --bursts 3 --variants lib
mv "$R/wire_probe.json" "$R/wire_ub.json" 2>/dev/null
XLA_FLAGS=$UB step coll_ub 80 $PY -m jaxopt_train.bench.collectives --sizes 1G,256M --dtypes f32 --chunks 1 \
  --iters 10 --bursts 3 --methods ring,ring_wire_bf16 --json "$R/coll_ub.json"
XLA_FLAGS=$UB step dp_ub 240 $PY -m jaxopt_train.bench.train --model gpt-1b --global-batch 16 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1 --xla-extra "$UB" --out "$R/gpt1b_x2_ub"
finish s9 30
grep -h '^\[probe\] {' "$R"/*.log >> "$OUT/summary.txt"
