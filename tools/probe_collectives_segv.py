"""Which reduction of tests/test_collectives_integration.py's odd mixed-dtype tree makes XLA:CPU
crash on jaxlib 0.11.2 (a segfault compiling it, forty-eighth session), and whether LLVM -O0
(the suite's XLA_FLAGS) matters: each case alone, in a process of its own, with and without it.

    JAX_PLATFORMS=cpu python3 tools/probe_collectives_segv.py      # prints one line per run
"""
import concurrent.futures
import os
import subprocess
import sys

CHILD = r"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, "tests")
import test_collectives_integration as t
which, index = sys.argv[1], int(sys.argv[2])
cases = t.CASES + t.COMPRESSED
if index < 0:  # lax.psum alone
    t.CASES, t.COMPRESSED = [], []
elif index < len(cases):
    t.CASES, t.COMPRESSED = ([cases[index]], []) if index < len(t.CASES) else ([], [cases[index]])
# else: every case, as the test runs them
(t.test_odd_mixed_dtype_trees_on_a_3_device_sub_mesh_match_psum if which == "shard_map"
 else t.test_odd_mixed_dtype_trees_under_pmap_match_psum)()
print("ok")
"""


def _run(flags: str, which: str, index: int) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd(), "XLA_FLAGS": flags}
    run = subprocess.run([sys.executable, "-c", CHILD, which, str(index)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or [""]
    return f"flags={flags or 'default'} {which} case={index} rc={run.returncode} {tail[0][:160]}"


def main() -> int:
    runs = [(flags, which, index) for flags in ("", "--xla_backend_optimization_level=0")
            for which in ("shard_map", "pmap")
            for index in [*range(-1, 8), 8, 8, 8]]  # -1: lax.psum alone; 8: all (three times)
    workers = int(os.environ.get("PROBE_WORKERS", "8"))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # processes do the work
        for line in pool.map(lambda run: _run(*run), runs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
