"""Issue 4's bf16-wire all-reduce on 2 devices: where do the last 10% go? A diagnostic.

    python tools/probe_wire.py [--sizes 256M,1G] [--iters 10] [--bursts 3]   # GPU pair
    python tools/probe_wire.py --dry                                          # CPU check

The library's 2-device exchange with a bf16 wire (`ring_all_reduce(x, wire_dtype=bf16)`) is
cast -> ppermute -> add; on two H200s it reaches 1.43-1.52x psum's f32 throughput (target 1.6x).
By the byte count the add should read this device's bf16 send buffer (0.5 bytes/elem less
than re-reading the f32 input), but XLA may fuse the cast into the add and re-read x. Each
variant below is timed in the same process against psum (f32), and checked on random data:

  lib          the library's exchange_all_reduce (the reference the others must equal)
  barrier      the same math with `lax.optimization_barrier` on the bf16 buffer, so the add
               reads the materialised bf16 copy instead of recomputing it from x
  split2       barrier, over two halves (two exchanges XLA may overlap with the adds)
  psum_bf16    NCCL's own all-reduce of the bf16 cast (not bit-equal: the sum is rounded to
               bf16 before it is widened; for scale only)

Prints time, f32-equivalent bus bandwidth and the ratio to psum f32; writes
$OUT/wire_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _variants():
    import jax.numpy as jnp
    from jax import lax

    from jaxopt_train.collectives import ring_all_reduce

    wire, acc = jnp.bfloat16, jnp.float32
    perm = [(0, 1), (1, 0)]

    def exchange(piece, barrier):
        mine = piece.astype(wire)
        if barrier:
            mine = lax.optimization_barrier(mine)
        theirs = lax.ppermute(mine, "data", perm)
        return mine.astype(acc) + theirs.astype(acc)

    def split2(x):
        half = x.shape[0] // 2
        return jnp.concatenate([exchange(x[:half], True), exchange(x[half:], True)])

    return {
        "psum": lambda x: lax.psum(x, "data"),
        "lib": lambda x: ring_all_reduce(x, "data", wire_dtype=wire),
        "barrier": lambda x: exchange(x, True),
        "split2": split2,
        "psum_bf16": lambda x: lax.psum(x.astype(wire), "data").astype(acc),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M,1G", help="f32 bytes per device")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--dry", action="store_true", help="CPU: 2 emulated devices, 64K and 1M")
    args = p.parse_args(argv)
    if args.dry:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
        args.sizes, args.iters, args.bursts = "64K,1M", 2, 2
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxopt_train.bench.collectives import fmt_size, parse_size, time_burst

    if jax.device_count() < 2:
        raise SystemExit(f"needs 2 devices, found {jax.device_count()}")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        elems = size // 4
        # Random data for the check (ones would hide rounding); 2 shards of `elems`.
        x = jax.device_put(jax.random.normal(jax.random.key(0), (2 * elems,), jnp.float32),
                           NamedSharding(mesh, P("data")))
        halves = np.asarray(x).reshape(2, elems)
        exact = (halves.astype(jnp.bfloat16).astype(np.float32)).sum(0)
        base = None
        for name, body in _variants().items():
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                       check_vma=False))
            out = np.asarray(fn(x)).reshape(2, elems)
            if name in ("lib", "barrier", "split2"):
                ok = bool(np.array_equal(out[0], exact) and np.array_equal(out[1], exact))
            elif name == "psum":
                ok = bool(np.allclose(out[0], halves.sum(0), rtol=1e-6, atol=1e-6))
            else:
                ok = bool(np.allclose(out[0], exact, rtol=2**-7, atol=1e-2))
            seconds = time_burst(fn, (x,), warmup=2, iters=args.iters, bursts=args.bursts)
            row = {"size_bytes": size, "variant": name, "time_us": seconds * 1e6,
                   "f32_busbw_gbs": size / seconds / 1e9, "checked": ok}
            base = base or row
            row["x_psum_f32"] = base["time_us"] / row["time_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x
    print(f"\n{'size':>6} {'variant':<10} {'time_us':>10} {'f32 GB/s':>9} {'x psum':>7} check")
    for r in rows:
        print(f"{fmt_size(r['size_bytes']):>6} {r['variant']:<10} {r['time_us']:>10.1f} "
              f"{r['f32_busbw_gbs']:>9.1f} {r['x_psum_f32']:>7.3f} {'ok' if r['checked'] else 'WRONG'}")
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "wire_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
