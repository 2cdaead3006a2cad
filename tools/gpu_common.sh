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
