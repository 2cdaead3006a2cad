"""`jaxopt-train bench SUITE ...`: dispatch to the benchmark modules.

Each suite module exposes `main(argv) -> int` and can also be run as
`python -m jaxopt_train.bench.SUITE`.
"""

from __future__ import annotations

import importlib
import sys

_SUITES = {
    "train": "baseline vs optimised training table (MFU, memory, step time)",
    "collectives": "psum vs ring all-reduce variants: bus bandwidth by size and dtype",
    "matmul": "Pallas / Triton matmul kernels vs XLA's dot: TFLOP/s",
    "accumulation": "full batch vs scan accumulation vs optax.MultiSteps at equal tokens",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxopt-train bench SUITE [ARGS ...]\n\nsuites:")
        for name, help_ in _SUITES.items():
            print(f"  {name:<13} {help_}")
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in _SUITES:
        print(f"jaxopt-train bench: unknown suite {suite!r}; expected one of {sorted(_SUITES)}",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"jaxopt_train.bench.{suite}").main(rest) or 0)
