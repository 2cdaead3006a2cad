"""A/B of the Mosaic GPU wrapper's padding on one Hopper GPU (sixteenth session).

    python tools/probe_tma_pad.py [--shapes MxNxK,...]   # prints a table, JSON in $OUT

Times, per shape, XLA's dot, our kernel as the library calls it (operands padded only to
TMA's granules, partial tiles left to TMA: `mosaic_gpu._tma_extent`), and the same kernel
with the earlier wrapper's padding (every dim zero-padded to whole tiles before the call,
the output sliced after it). Same kernel, same config: the difference is the copies.
Timing is `bench.matmul.time_fn` over rotating random inputs; results are checked
against XLA's f32 product first.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
from _ab_timing import time_checked, write_rows

from jaxopt_train.bench.matmul import _input_sets
from jaxopt_train.kernels.autotune import parse_shapes
from jaxopt_train.kernels.matmul import _round_up, resolve_config
from jaxopt_train.kernels.mosaic_gpu import cluster_tile, mosaic_matmul

SHAPES = "3000x4096x1024,8000x2048x8192,1000x4096x4096,3000x5000x1000,1000x777x513"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    rows = []
    for m, n, k in parse_shapes(parser, "--shapes", args.shapes):
        config = resolve_config("mosaic_gpu", m, n, k, jnp.bfloat16)
        unit_m, unit_n = cluster_tile(config)
        mp, np_, kp = _round_up(m, unit_m), _round_up(n, unit_n), _round_up(k, config.block_k)

        def ours(a, b, bias):
            return mosaic_matmul(a, b, None, activation=None, out_dtype=jnp.bfloat16, config=config)

        def whole_tiles(a, b, bias):
            a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
            b = jnp.pad(b, ((0, kp - k), (0, np_ - n)))
            return ours(a, b, bias)[:m, :n]

        fns = {"xla_dot": lambda a, b, bias: jnp.dot(a, b),
               "tma_edges": ours, "whole_tiles": whole_tiles}
        sets = _input_sets(m, n, k, jnp.bfloat16, 4)
        a, b, _ = sets[0]
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        row = {"shape": [m, n, k], **time_checked(fns, sets, ref, f"{m}x{n}x{k}")}
        row["tma_vs_whole"] = row["whole_tiles"] / row["tma_edges"]
        row["tma_vs_xla"] = row["xla_dot"] / row["tma_edges"]
        print(f"{m}x{n}x{k}: xla {row['xla_dot']:.1f} us, tma_edges {row['tma_edges']:.1f} us, "
              f"whole_tiles {row['whole_tiles']:.1f} us: {row['tma_vs_whole']:.3f}x faster, "
              f"{row['tma_vs_xla']:.3f}x XLA", flush=True)
        rows.append(row)
    write_rows("tma_pad.json", rows)


if __name__ == "__main__":
    main()
