"""Forward + backward products of gpt-1b's dense layers: XLA vs our Mosaic GPU kernel.

    python tools/probe_matmul_bwd.py [--configs NAME=JSON ...]   # JSON at $OUT/matmul_bwd.json

Per (M, K, N) shape it times, one by one, the three products a dense layer needs per
step, out = a @ b, da = g @ b.T, db = a.T @ g (bf16 in, f32 accumulation, bf16 out):
  xla         jnp.dot (XLA picks transposed cuBLAS calls itself);
  mosaic      our kernel with the shipped config, reading transposed operands as stored;
  NAME        our kernel with that MatmulConfig override (fields of the shipped config
              replaced by JSON, e.g. pingpong='{"schedule": "pingpong"}').
Each product is checked against XLA's f32 result before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

SHAPES = [(8192, 2048, 6144), (8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048),
          (8192, 2048, 50304)]
PRODUCTS = ("out", "da", "db")


def _products(a, b, g, mm, dot, configs):
    """The three products as (name, fn, args); `configs` per product for our kernel."""
    if mm is None:
        return [("out", lambda a, b: dot(a, b), (a, b)), ("da", lambda g, b: dot(g, b.T), (g, b)),
                ("db", lambda a, g: dot(a.T, g), (a, g))]
    cf, cda, cdb = configs
    return [("out", lambda a, b: mm(a, b, cf), (a, b)),
            ("da", lambda g, b: mm(g, b, cda, transpose_b=True), (g, b)),
            ("db", lambda a, g: mm(a, g, cdb, transpose_a=True), (a, g))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="probe_matmul_bwd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=[], metavar="NAME=JSON",
                        help="extra variants: the shipped config with these fields replaced")
    parser.add_argument("--no-default", action="store_true", help="skip the shipped config")
    parser.add_argument("--bursts", type=int, default=5)
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxopt_train.bench.collectives import time_burst
    from jaxopt_train.kernels.matmul import resolve_config
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    bf16 = jnp.bfloat16
    overrides = {} if args.no_default else {"mosaic": {}}
    for spec in args.configs:
        name, _, text = spec.partition("=")
        overrides[name] = json.loads(text)

    def mm(a, b, cfg, **t):
        return mosaic_matmul(a, b, None, activation=None, out_dtype=bf16, config=cfg, **t)

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(bf16)

    rows = []
    for m, k, n in SHAPES:
        ka, kb, kg = jax.random.split(jax.random.key(0), 3)
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(bf16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(bf16)
        g = jax.random.normal(kg, (m, n), jnp.float32).astype(bf16)
        shipped = (resolve_config("mosaic_gpu", m, n, k, bf16),  # forward, dA (B^T), dB (A^T)
                   resolve_config("mosaic_gpu", m, k, n, bf16, "b"),
                   resolve_config("mosaic_gpu", k, n, m, bf16, "a"))
        ref = {name: np.asarray(jax.jit(fn)(*xs), np.float32)
               for name, fn, xs in _products(a, b, g, None, dot, None)}
        variants = {"xla": None, **overrides}
        for variant, change in variants.items():
            configs = None if change is None else tuple(dataclasses.replace(c, **change) for c in shipped)
            row = {"shape": [m, k, n], "variant": variant, "config_change": change}
            for name, fn, xs in _products(a, b, g, None if change is None else mm, dot, configs):
                try:
                    f = jax.jit(fn)
                    out = np.asarray(f(*xs), np.float32)
                    err = float(np.max(np.abs(out - ref[name])) / max(1.0, float(np.max(np.abs(ref[name])))))
                    sec = time_burst(f, xs, warmup=3, iters=10, bursts=args.bursts)
                    row[name] = {"ms": sec * 1e3, "max_rel_err": err}
                except Exception as e:  # noqa: BLE001 - report and go on
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            if all("ms" in row[p] for p in PRODUCTS):
                row["ms"] = sum(row[p]["ms"] for p in PRODUCTS)
                row["tflops"] = 3 * 2 * m * k * n / row["ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "matmul_bwd.json"), "w") as f:
        json.dump(rows, f, indent=1)
    _print_table(rows)
    return 0


def _print_table(rows):
    xla = {tuple(r["shape"]): r for r in rows if r["variant"] == "xla"}
    print(f"\n{'shape (M,K,N)':<22} {'variant':<14} {'ms':>8} {'TFLOP/s':>8} "
          + " ".join(f"{p + ' vs xla':>10}" for p in PRODUCTS) + f" {'all vs xla':>10} {'err':>8}")
    for r in rows:
        base = xla.get(tuple(r["shape"]), {})
        if "ms" not in r:
            errors = [r[p].get("error", "") for p in PRODUCTS]
            print(f"{str(tuple(r['shape'])):<22} {r['variant']:<14} ERROR {' | '.join(e[:100] for e in errors if e)}")
            continue
        ratios = [base[p]["ms"] / r[p]["ms"] if "ms" in base.get(p, {}) else float("nan") for p in PRODUCTS]
        total = base["ms"] / r["ms"] if "ms" in base else float("nan")
        err = max(r[p]["max_rel_err"] for p in PRODUCTS)
        print(f"{str(tuple(r['shape'])):<22} {r['variant']:<14} {r['ms']:8.3f} {r['tflops']:8.0f} "
              + " ".join(f"{x:10.3f}" for x in ratios) + f" {total:10.3f} {err:8.1e}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
