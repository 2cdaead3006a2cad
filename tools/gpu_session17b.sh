#!/usr/bin/env bash
# Seventeenth session, call 3 (~8 min on nvidia-h200). Calls 1 and 2 profiled the same optimised
# gpt-1b step twice: once XLA's autotuner picked Triton GEMM fusions for four of its dots (62.2 ms
# of matmul, 89.5 ms step), once cuBLAS for all of them (59.4 ms, 87.3 ms). Is the run-to-run
# spread of this step (85-89.5 ms over the sessions) the autotuner's pick, and does
# --xla_gpu_enable_triton_gemm=false take the low side every time?
# 1. The bench's default step (probe optcopy) with and without the flag, alternating, profiled
#    (the profile names the GEMM kernels each run got).
# 2. `bench train` gpt-1b on one GPU with the flag: the issue-6 table.
#   bash tools/gpu_session17b.sh
set -u
OUT=${OUT:-/tmp/s17b_out}; R=/tmp/s17b; mkdir -p "$R" "$OUT"
export DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
NOTRITON="--xla_gpu_enable_triton_gemm=false"
for i in ${ROUNDS:-1 2}; do
  [ -z "${SKIP_DEFAULT:-}" ] && OUT=$R step "p_default$i" 110 $PY tools/probe_gpt1b.py --variants optcopy --profile --warmup-s 10 \
    --tag "_default$i"
  OUT=$R step "p_notriton$i" 110 $PY tools/probe_gpt1b.py --variants optcopy --profile --warmup-s 10 \
    --tag "_notriton$i" --xla-extra="$NOTRITON"
done
$PY - "$R" > "$OUT/probes.txt" <<'PYEOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "gpt1b_probe_*.json"))):
    row = json.load(open(path))[0]; prof = row.get("profile", {})
    gemm = sorted((n, round(ms, 2)) for n, ms in prof.get("top_kernels_ms_per_step", [])
                  if "gemm_fusion" in n or "nvjet" in n)
    print(os.path.basename(path), "step", round(row["step_ms"], 2), "bursts",
          [round(b, 2) for b in row["bursts_ms"]], "mfu", round(row["mfu"], 4),
          "by_kind", {k: round(v, 2) for k, v in prof.get("by_kind_ms_per_step", {}).items()})
    print("   ", gemm)
PYEOF
cat "$OUT/probes.txt"
STEP_TAIL=25 step bench_notriton 240 $PY $GPT1B_BENCH --no-scaling --warmup-s 15 \
  --xla-extra="$NOTRITON" --out "$OUT/gpt1b_notriton"
finish s17b 25 --exclude=trace_* --exclude=*.trace.json.gz
