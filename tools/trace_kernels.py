"""Launch details of the GPU kernels in a `jax.profiler` trace whose names match a pattern.

    python tools/trace_kernels.py LOGDIR_OR_FILE REGEX [--steps 3]

`probe_gpt1b.py --profile` sums kernel time by name, and every Mosaic GPU launch is named
`bound_mosaic_gpu_kernel`, so two different products look like one kernel there. This groups
the matching kernels by (name, grid, block, registers, shared memory) instead and prints each
group's launches and mean time, so a slower product or fusion can be told apart.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("pattern", help="regular expression searched in the kernel name")
    p.add_argument("--steps", type=int, default=3, help="training steps in the traced window")
    args = p.parse_args(argv)
    from jaxopt_train.runtime.overlap import read_trace

    pattern = re.compile(args.pattern)
    groups = collections.defaultdict(list)
    for e in read_trace(args.trace).events:
        name = e.get("name", "")
        if e.get("ph") != "X" or not pattern.search(name):
            continue
        details = (e.get("args") or {}).get("kernel_details")
        if details is None:  # the host-side op event, not the kernel
            continue
        groups[(name, details)].append(float(e.get("dur", 0.0)))
    print(f"{'launches/step':>13} {'mean us':>9} {'ms/step':>8}  name  details")
    for (name, details), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{len(durs) / args.steps:13.1f} {sum(durs) / len(durs):9.1f} "
              f"{sum(durs) / 1e3 / args.steps:8.3f}  {name}  {details}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
