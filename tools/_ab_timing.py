"""Shared by the A/B probes of a kernel wrapper (`probe_tma_pad.py`, `probe_triton_align.py`):
each way of computing one product is checked against a reference, then timed."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from jaxopt_train.bench.matmul import time_fn


def time_checked(fns: dict, sets: list, ref: jax.Array, label: str) -> dict[str, float]:
    """{name: us per call} for each jitted `fns[name](*set)`, timed by `bench.matmul.time_fn`
    over the rotating `sets` (median of 5 bursts x 20 calls, 2 s warm-up); first each result
    on `sets[0]` against `ref`, exiting on a relative error above 1e-2."""
    times = {}
    for name, fn in fns.items():
        fn = jax.jit(fn)
        err = float(jnp.max(jnp.abs(fn(*sets[0]).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        if err > 1e-2:
            raise SystemExit(f"{name} {label}: relative error {err:.1e}")
        times[name] = 1e6 * time_fn(fn, sets, calls=20, bursts=5, warmup_s=2)
    return times


def write_rows(filename: str, rows: list[dict]) -> None:
    """The rows as JSON in $OUT/`filename` (the device tool brings $OUT back); no $OUT: nothing."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, filename), "w") as f:
            json.dump(rows, f, indent=1)
