# Shared by the tools/gpu_*.sh device scripts: `source` it after setting R (the log folder).
# Sets the environment every GPU run here needs (never NVLink multicast), PY, t0, and
#   step NAME TIMEOUT CMD...   run CMD with a time limit, log to $R/NAME.log, record rc and
#                              seconds in $R/steps.log (and print the log's last $STEP_TAIL lines);
#                              with DEADLINE=<seconds after t0> the limit shrinks to end by then,
#                              and a step with under 20 s left is skipped (rc=skip)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
t0=$(date +%s)
step() {
  local name=$1 limit=$2; shift 2; local s=$(date +%s)
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( t0 + DEADLINE - s ))
    if [ "$left" -lt 20 ]; then echo "=== [$name] rc=skip: ${left}s left before DEADLINE" | tee -a "$R/steps.log"; return 0; fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
  fi
  echo "=== [$name] start +$((s - t0))s: $*" | tee -a "$R/steps.log"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "=== [$name] rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$R/steps.log"
  if [ "${STEP_TAIL:-0}" -gt 0 ]; then tail -n "$STEP_TAIL" "$R/$name.log"; fi
  return 0
}
# The trainer's and the bench's gpt-1b steps as BENCHMARKS.md measures them. Since the twelfth
# session `bench train` warms every config up for 15 s (--warmup-s): ~15 s more per config.
GPT1B_TRAIN="-m jaxopt_train.train.cli --preset gpt-1b --steps ${TRAIN_STEPS:-40} --batch-size 8 --precision bf16 \
  --warmup 10 --lr 3e-4 --log-every 10 --eval-every 0 --checkpoint-every 0 --progress lines --overwrite \
  --grad-dtype compute --opt-state-dtype bf16"
GPT1B_BENCH="-m jaxopt_train.bench.train --model gpt-1b --global-batch 8 --microbatches 1 --steps 30 \
  --warmup 5 --bursts 3 --trace-steps 5 --steps-per-dispatch 1"
gpt1b_probe() {  # gpt1b_probe TAG SPEC: the bench's optimised gpt-1b step (tools/probe_gpt1b.py
                 # --variants opt) with SPEC = xla (XLA's dot), empty (our kernel, shipped config) or
                 # MatmulConfig JSON fields without spaces; log $R/step_TAG.log, JSON $R/gpt1b_probe_TAG.json
  local kernel=(--matmul pallas ${2:+--matmul-config "$2"})
  if [ "$2" = xla ]; then kernel=(); fi
  OUT=$R step "step_$1" ${T_P:-160} $PY tools/probe_gpt1b.py --variants opt --tag "_$1" "${kernel[@]}"
}
finish() {  # finish ARCHIVE [TAIL [TAR_OPTION...]]: total time; $OUT/summary.txt holds the last TAIL
            # lines of each log; $R is packed into $OUT/ARCHIVE.tar.gz (the tool returns <= 8 files)
  local archive=$1 tail_n=${2:-30}; shift $(( $# < 2 ? $# : 2 ))
  echo "total $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.log"
  local f; for f in "$R"/*.log; do echo "----- $f"; tail -n "$tail_n" "$f"; done > "$OUT/summary.txt"
  tar czf "$OUT/$archive.tar.gz" "$@" -C "$(dirname "$R")" "$(basename "$R")"
  # Printed last, so the reply's output tail always holds every step's outcome: in session 42
  # the first step's pytest count scrolled out of it, and the fetched files were then lost.
  echo "===== recap"; cat "$R/steps.log"
  for f in "$R"/*.log; do
    local counts; counts=$(grep -hE "[0-9]+ (passed|failed|error)" "$f" | tail -n 1)
    if [ -n "$counts" ]; then echo "$(basename "$f" .log): $counts"; fi
  done
}
install_whl() {  # install_whl: the carried .whl/ wheels (jax-triton) into /tmp/site, which the
                 # caller puts on PYTHONPATH; without .whl/ a line in steps.log says Triton will skip
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1 || echo "=== no .whl/: Triton will be skipped" | tee -a "$R/steps.log"
}
cap_memory() {  # cap_memory GIB: XLA's allocator pool on GPU 0 capped at GIB GiB (a hard budget,
                # as on a smaller GPU); logged to $R/steps.log. CAP_PREALLOCATE=true reserves the
                # cap as one region at start-up (XLA's default); otherwise the pool grows in
                # regions, and no buffer can span two of them
  local total_mib
  export XLA_PYTHON_CLIENT_PREALLOCATE=${CAP_PREALLOCATE:-false}
  total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(f'{$1 * 1024 / $total_mib:.4f}')")
  echo "GPU memory ${total_mib} MiB; XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION" \
    "XLA_PYTHON_CLIENT_PREALLOCATE=$XLA_PYTHON_CLIENT_PREALLOCATE" \
    | tee -a "$R/steps.log"
}
parts_ok() {  # parts_ok N: true if N is a part count run_id_parts takes (1 to 8), else says so
  case "$1" in [1-8]) return 0 ;; esac
  echo "$1 parts: expected a number from 1 to 8" >&2; return 1
}
run_id_parts() {  # run_id_parts NAME IDS_FILE N LIMIT: the pytest node ids in IDS_FILE (blank lines
                  # skipped) split N ways (part a: ids 1, 1+N, ...; N <= 8), each part a background
                  # `step NAME_<a..h> LIMIT $T <ids>` with its ids in $R/NAME_<a..h>.txt; the
                  # caller sets T (its pytest command) and waits
  local name=$1 ids=$2 n=$3 limit=$4 letters=(a b c d e f g h) i part
  parts_ok "$n" || return 2
  for i in $(seq 0 $((n - 1))); do
    part="${name}_${letters[$i]}"
    awk -v n="$n" -v i="$i" 'NF && (NR - 1) % n == i' "$ids" > "$R/$part.txt"
    if [ -s "$R/$part.txt" ]; then
      STEP_TAIL=4 step "$part" "$limit" $T $(cat "$R/$part.txt") &
    fi
  done
}
