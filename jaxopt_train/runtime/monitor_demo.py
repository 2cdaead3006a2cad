"""Demo of GPUMonitor: `python -m jaxopt_train.runtime.monitor_demo [--load] [--json PATH]`.

Samples every GPU for a few seconds, optionally while bf16 matmuls keep the first one
busy, and prints the mean/min/max of each DCGM field: the quickest way to see
monitoring work on a GPU machine (utilisation near 100% and power rising under load).
"""

from __future__ import annotations

import json
import math
import time

from jaxopt_train.runtime.monitor import GPUMonitor


def _matmul_load(seconds: float) -> int:
    """Keeps the default device busy with bf16 matmuls for about `seconds`; returns calls."""
    import jax
    import jax.numpy as jnp

    size = 8192 if jax.default_backend() == "gpu" else 256
    a = jnp.ones((size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    matmul(a).block_until_ready()
    calls, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(10):  # bursts with one sync: keeps the GPU queue full
            out = matmul(a)
        out.block_until_ready()
        calls += 10
    return calls


def _write_json(path: str, report: dict) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(report, file, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Demo: sample the GPUs for a few seconds (optionally under a matmul load) and print a summary."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxopt_train.runtime.monitor_demo",
                                     description="Sample DCGM-named GPU fields via NVML and summarise them.")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to sample")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--load", action="store_true", help="run bf16 matmuls meanwhile")
    parser.add_argument("--json", metavar="PATH", help="write the summary and all samples as JSON "
                        "(without a GPU: gpu_found false and the reason)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.seconds) and args.seconds >= 0):  # time.sleep raised on < 0
        parser.error(f"--seconds must be a finite number >= 0; got {args.seconds}")
    try:
        monitor = GPUMonitor(interval_s=args.interval)
    except ValueError as err:
        parser.error(f"--interval: {err}")
    calls = 0
    with monitor:
        if args.load:
            calls = _matmul_load(args.seconds)
        else:
            time.sleep(args.seconds)
    if not monitor.enabled:
        # A script reading PATH gets the reason rather than a missing file.
        if args.json:
            _write_json(args.json, {"gpu_found": False, "reason": monitor.reason,
                                    "summary": {}, "samples": {}})
        return 0
    summary = monitor.summary()
    print(f"{'field':<40} {'mean':>10} {'min':>10} {'max':>10} {'samples':>8}")
    for key, stats in summary.items():
        print(f"{key:<40} {stats['mean']:>10.1f} {stats['min']:>10.1f} {stats['max']:>10.1f} "
              f"{int(stats['count']):>8}")
    if args.load:
        print(f"load: {calls} matmul calls in {args.seconds:.1f} s")
    if args.json:
        samples = {f"gpu{i}": [{"time": t, **s} for t, s in buf] for i, buf in monitor.samples.items()}
        _write_json(args.json, {"gpu_found": True, "summary": summary, "samples": samples})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
