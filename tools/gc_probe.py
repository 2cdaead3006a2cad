"""Runs `jaxopt-train train` (the arguments after this script's own) and logs every
generation-2 garbage collection to stderr: when, how long, how many objects the collector
tracks. With --gc-freeze the trainer's compile is followed by gc.collect() + gc.freeze(), so
later collections skip everything alive after compilation (MLIR objects of the lowering...).

    python3 tools/gc_probe.py [--gc-freeze] --preset gpt-1b ... --matmul pallas
"""

import gc
import sys
import time

from jaxopt_train.train import cli
from jaxopt_train.train.trainer import Trainer

t0 = time.perf_counter()
started = [0.0]


def _log(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        started[0] = time.perf_counter()
        return
    took = time.perf_counter() - started[0]
    print(f"gc gen2 at +{time.perf_counter() - t0:.1f}s took {took * 1e3:.1f} ms, "
          f"collected {info['collected']}, tracked {len(gc.get_objects())}, "
          f"frozen {gc.get_freeze_count()}", file=sys.stderr, flush=True)


gc.callbacks.append(_log)
freeze = "--gc-freeze" in sys.argv
argv = [a for a in sys.argv[1:] if a != "--gc-freeze"]
if freeze:
    original = Trainer._compile_staged

    def _compile_then_freeze(self, staged):
        original(self, staged)
        gc.collect()
        gc.freeze()
        print(f"gc frozen after compile: {gc.get_freeze_count()} objects", file=sys.stderr, flush=True)

    Trainer._compile_staged = _compile_then_freeze
sys.exit(cli.main(argv))
