"""`frozen_collector()`: a training loop that Python's garbage collector does not stall.

A compiled step keeps a large Python side alive for the whole run (its jaxprs and the
lowering's objects: ~600,000 tracked objects for gpt-1b with Mosaic GPU matmuls). Every
generation-2 pass of the cyclic collector walks all of them, and one lands every few dozen
steps: on an H200 a gpt-1b step took 0.28-0.40 s instead of 0.09 s under --matmul pallas,
and 0.15 s under xla (BENCHMARKS.md, thirty-third session). `gc.freeze()` moves what is
alive into a generation the collector skips; those passes then take ~20 ms.
"""

from __future__ import annotations

import contextlib
import gc

_depth = 0  # open frozen_collector() blocks (a train() inside a loop of the caller's own)


@contextlib.contextmanager
def frozen_collector():
    """Freezes what is alive on entry (call it after compiling), unfreezes on exit.

    Garbage made so far is collected first, so it is freed rather than kept for the run.
    Freezing is only a hint to the collector, so it is done whatever was frozen before
    (Python 3.12 on the GPU machine starts with 375 objects frozen), and the outermost
    block's exit unfreezes all of it (gc has no partial unfreeze; objects still in use stay
    alive either way), so a process that trains again collects what this run left behind.

        trainer.compile(batch)
        with frozen_collector():
            for batch in batches:
                trainer.step(batch)
    """
    global _depth
    gc.collect()
    gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:  # a nested block leaves the outer one's objects frozen
            gc.unfreeze()
