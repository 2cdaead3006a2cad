"""Issue 4's bf16-wire all-reduce on 2 devices: where do the last 10% go? A diagnostic.

    python tools/probe_wire.py [--sizes 256M,1G] [--iters 10] [--bursts 3]   # GPU pair
    python tools/probe_wire.py --dry                                          # CPU check

The library's 2-device exchange with a bf16 wire (`ring_all_reduce(x, wire_dtype=bf16)`) is
cast -> ppermute -> add; on two H200s it reached 1.43-1.52x psum's f32 throughput (target 1.6x).
The seventh session's run of this probe found the unpinned cast also WRONG on GPU: XLA folds the
sender's f32 -> bf16 -> f32 pair away, so the two devices' sums differed. The library now pins its
own wire copy (`collectives.ring.wire_cast`, an optimization barrier). Each variant below is timed
in the same process against psum (f32), and checked on random data:

  lib          the library's exchange_all_reduce (pinned wire copy): must equal the exact sum
  unpinned     cast -> ppermute -> add without the pin (the old library code; GPU: not bit-equal)
  dus2, dus4   the pinned exchange over 2 / 4 contiguous pieces, each written into one output
               buffer with dynamic_update_slice (lets XLA overlap one piece's transfer with
               another's cast and add, when its scheduler does)
  cat2         the same over 2 pieces joined with concatenate
  ovl2, ovl4   2 / 4 pieces whose casts are chained through barriers (XLA otherwise merges
               them into one kernel, so nothing overlaps), each sent as soon as it is cast;
               one add over all pieces at the end
  psum_bf16    NCCL's own all-reduce of the bf16 cast (not bit-equal: the sum is rounded to
               bf16 before it is widened; for scale only)
  ag           NCCL's all-gather as the transport (tenth session): the bf16 casts of both
               devices gathered into one (2, n) buffer, then one add in f32. Both devices add
               the same gathered pair in the same order, so no pin is needed
  ag_f32       the same with the f32 data itself (the f32 ring's transport; vs psum f32)
  lib_f32      the library's f32 exchange (ppermute, no wire dtype), for comparison with ag_f32

With --hlo DIR each variant's optimised HLO is written there (to see the schedule).
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

    def exchange(piece, pin):
        mine = piece.astype(wire)
        if pin:
            mine = lax.optimization_barrier(mine)
        theirs = lax.ppermute(mine, "data", perm)
        return mine.astype(acc) + theirs.astype(acc)

    def dus(x, k):
        size = x.shape[0] // k
        out = jnp.zeros_like(x)
        for i in range(k):
            out = lax.dynamic_update_slice(out, exchange(x[i * size:(i + 1) * size], True), (i * size,))
        return out

    def overlapped(x, k):
        # Casts chained through barriers on the whole input (no copy), so XLA cannot merge
        # them into one kernel: cast i+1 can run while piece i is on the wire; one add at the end.
        size = -(-x.shape[0] // k)
        mines, theirs, source = [], [], x
        for i in range(k):
            mine = lax.optimization_barrier(source[i * size:(i + 1) * size].astype(wire))
            mines.append(mine)
            theirs.append(lax.ppermute(mine, "data", perm))
            source, _ = lax.optimization_barrier((x, mine))
        return jnp.concatenate([m.astype(acc) + t.astype(acc) for m, t in zip(mines, theirs)])

    def gathered_sum(x):
        both = lax.all_gather(x, "data")  # (2, n), identical on both devices
        return both[0].astype(acc) + both[1].astype(acc)

    def cat2(x):
        half = x.shape[0] // 2
        return jnp.concatenate([exchange(x[:half], True), exchange(x[half:], True)])

    return {
        "psum": lambda x: lax.psum(x, "data"),
        "lib": lambda x: ring_all_reduce(x, "data", wire_dtype=wire),
        "unpinned": lambda x: exchange(x, False),
        "dus2": lambda x: dus(x, 2),
        "dus4": lambda x: dus(x, 4),
        "cat2": cat2,
        "ovl2": lambda x: overlapped(x, 2),
        "ovl4": lambda x: overlapped(x, 4),
        "psum_bf16": lambda x: lax.psum(x.astype(wire), "data").astype(acc),
        "ag": lambda x: gathered_sum(x.astype(wire)),
        "ag_f32": gathered_sum,
        "lib_f32": lambda x: ring_all_reduce(x, "data"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M,1G", help="f32 bytes per device")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--variants", default=None, help="comma-separated subset (psum always runs first)")
    p.add_argument("--hlo", default=None, help="write each variant's optimised HLO to this folder")
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
        chosen = _variants()
        if args.variants:
            wanted = ["psum"] + [v for v in args.variants.split(",") if v != "psum"]
            unknown = sorted(set(wanted) - set(chosen))
            if unknown:
                raise SystemExit(f"unknown --variants {unknown}; expected some of {sorted(chosen)}")
            chosen = {v: chosen[v] for v in wanted}
        for name, body in chosen.items():
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                       check_vma=False))
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                with open(os.path.join(args.hlo, f"{name}_{fmt_size(size)}.txt"), "w") as f:
                    f.write(fn.lower(x).compile().as_text())
            out = np.asarray(fn(x)).reshape(2, elems)
            if name in ("psum", "ag_f32", "lib_f32"):
                ok = bool(np.allclose(out[0], halves.sum(0), rtol=1e-6, atol=1e-6))
            elif name == "psum_bf16":  # the sum is rounded to bf16: close, not equal
                ok = bool(np.allclose(out[0], exact, rtol=2**-7, atol=1e-2))
            else:  # every exchange: the exact f32 sum of the two bf16-rounded inputs, on both devices
                ok = bool(np.array_equal(out[0], exact) and np.array_equal(out[1], exact))
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
    # The unpinned variant is expected to fail its check on GPU (that is the finding).
    return 0 if all(r["checked"] for r in rows if r["variant"] != "unpinned") else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
