#!/usr/bin/env bash
# The CPU test suite on the GPU machine's jax (0.11.2 there; CI and this VM have 0.10.2), which
# code must also work on: JAX_PLATFORMS=cpu, 8 emulated devices (tests/conftest.py), the GPU tests
# skipped. The notebooks are left out (no nbmake there). pytest-xdist and execnet come as wheels:
#   .venv/bin/pip download -q pytest-xdist execnet --no-deps -d .whl   # beside jax-triton's
#   bash tools/gpu_cpu_suite.sh                # carry [".whl"]; CPU_TESTS=... for some files only
# Logs go straight to $OUT, so a call cut by its limit still returns what ran ("-v": one line
# per test, so the FAILED ones are named even without pytest's summary).
set -u
OUT=${OUT:-/tmp/cpu_out}; R=$OUT/cpu_suite; mkdir -p "$R"
export DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
install_whl
$PY -c "import xdist" 2>/dev/null || echo "=== no pytest-xdist: carry its wheel in .whl/" | tee -a "$R/steps.log"
# CI's CPU flag (conftest adds its flags only where no CUDA plugin is installed, which here is);
# 0.11.2 has no --xla_cpu_use_fusion_emitters, so that one stays out.
export PYTHONPATH=/tmp/site:$PYTHONPATH JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices()[:1])" \
  2>&1 | tail -1 | tee -a "$R/steps.log"
# shellcheck disable=SC2086  # CPU_TESTS is a list of paths
STEP_TAIL=40 step cpu_suite 560 $PY -m pytest -v -rfE -n "${WORKERS:-16}" --dist "${DIST:-load}" \
  -p no:cacheprovider ${CPU_TESTS:-tests}
grep -hE "(FAILED|ERROR) tests/" "$R/cpu_suite.log" | sort -u > "$R/failed.txt"
echo "$(grep -c " PASSED " "$R/cpu_suite.log") passed, $(wc -l < "$R/failed.txt") failed or errored" \
  | tee -a "$R/steps.log"
finish cpu_suite 40
