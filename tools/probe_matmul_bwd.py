"""Forward + backward products of gpt-1b's dense layers: XLA vs our Mosaic GPU kernel.

    python tools/probe_matmul_bwd.py     # one Hopper GPU; JSON at $OUT/matmul_bwd.json

Per (M, K, N) shape it times the three products a dense layer needs per step,
out = a @ b, da = g @ b.T, db = a.T @ g (bf16 in, f32 accumulation, bf16 out):
  xla         jnp.dot for all three (XLA picks transposed cuBLAS calls itself);
  mosaic_copy our kernel with materialised transposes (the old backward);
  mosaic_t    our kernel reading the transposed operand as stored (the new backward).
Each variant is checked against XLA's f32 result before timing.
"""

from __future__ import annotations

import json
import os
import sys

SHAPES = [(8192, 2048, 6144), (8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048),
          (8192, 2048, 50304)]


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxopt_train.bench.collectives import time_burst
    from jaxopt_train.kernels.matmul import resolve_config
    from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

    bf16 = jnp.bfloat16

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
        cf, cda, cdb = (resolve_config("mosaic_gpu", m, n, k, bf16), resolve_config("mosaic_gpu", m, k, n, bf16),
                        resolve_config("mosaic_gpu", k, n, m, bf16))
        variants = {
            "xla": lambda a, b, g: (dot(a, b), dot(g, b.T), dot(a.T, g)),
            "mosaic_copy": lambda a, b, g: (mm(a, b, cf), mm(g, b.T, cda), mm(a.T, g, cdb)),
            "mosaic_t": lambda a, b, g: (mm(a, b, cf), mm(g, b, cda, transpose_b=True),
                                         mm(a, g, cdb, transpose_a=True)),
        }
        ref = [np.asarray(x, np.float32) for x in jax.jit(variants["xla"])(a, b, g)]
        flops = 3 * 2 * m * k * n
        for name, fn in variants.items():
            row = {"shape": [m, k, n], "variant": name}
            try:
                f = jax.jit(fn)
                out = f(a, b, g)
                err = max(float(np.max(np.abs(np.asarray(o, np.float32) - r)) / max(1.0, float(np.max(np.abs(r)))))
                          for o, r in zip(out, ref))
                sec = time_burst(f, (a, b, g), warmup=3, iters=10, bursts=5)
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, max_rel_err=err)
            except Exception as e:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "matmul_bwd.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'shape (M,K,N)':<22} {'variant':<12} {'ms':>8} {'TFLOP/s':>8} {'vs xla':>7} {'err':>8}")
    xla_ms = {tuple(r["shape"]): r.get("ms") for r in rows if r["variant"] == "xla"}
    for r in rows:
        if "error" in r:
            print(f"{str(tuple(r['shape'])):<22} {r['variant']:<12} ERROR {r['error'][:120]}")
            continue
        base = xla_ms.get(tuple(r["shape"]))
        print(f"{str(tuple(r['shape'])):<22} {r['variant']:<12} {r['ms']:8.3f} {r['tflops']:8.0f} "
              f"{(base / r['ms'] if base else float('nan')):7.3f} {r['max_rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
