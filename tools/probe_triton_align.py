"""A/B of the Triton wrapper's 16-byte row padding on one GPU (seventeenth session).

    python tools/probe_triton_align.py [--shapes MxNxK:layout,...]   # a table; JSON in $OUT

Times, per shape and operand layout (nn: A @ B; tn: A stored (K, M); nt: B stored (N, K)),
XLA's dot, the Triton kernel as the library calls it (each operand's minor dim padded to a
multiple of 8 elements, `triton_kernel.aligned_operands`, so Triton can pipeline its loads)
and the same kernel and config reading the operands as given (`align=False`, the wrapper
before this session). The default shapes are odd ones and the products of a tied head over
GPT-2's 50,257-token vocabulary (forward, dA, dB). Timing is `bench.matmul.time_fn` over
rotating random inputs; every result is checked against XLA's f32 product first.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
from _ab_timing import time_checked, write_rows

from jaxopt_train.bench.matmul import _input_sets
from jaxopt_train.kernels.autotune import parse_shapes
from jaxopt_train.kernels.matmul import resolve_config
from jaxopt_train.kernels.triton_kernel import triton_matmul

SHAPES = ("1000x777x513:nn,3000x5000x1000:nn,8192x50257x2048:nt,8192x2048x50257:nn,"
          "50257x2048x8192:tn")
LAYOUTS = {"nn": (False, False), "tn": (True, False), "nt": (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma list of MxNxK:layout "
                        f"(layout one of {sorted(LAYOUTS)})")
    args = parser.parse_args()
    rows = []
    for item in args.shapes.split(","):
        spec, _, layout = item.partition(":")
        if layout not in LAYOUTS:
            parser.error(f"--shapes: {item!r} needs a layout suffix, one of {sorted(LAYOUTS)}")
        ((m, n, k),) = parse_shapes(parser, "--shapes", spec)
        transpose_a, transpose_b = LAYOUTS[layout]
        config = resolve_config("triton", m, n, k, jnp.bfloat16)

        def kernel(align):
            return lambda a, b, bias: triton_matmul(
                a, b, None, activation=None, out_dtype=jnp.bfloat16, config=config,
                transpose_a=transpose_a, transpose_b=transpose_b, align=align)

        def xla_dot(a, b, bias):
            return jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b)

        # Each input set stored in the layout the calls read, so no timed call transposes.
        sets = [(a.T if transpose_a else a, b.T if transpose_b else b, bias)
                for a, b, bias in _input_sets(m, n, k, jnp.bfloat16, 4)]
        ref = xla_dot(sets[0][0].astype(jnp.float32), sets[0][1].astype(jnp.float32), None)
        fns = {"xla_dot": xla_dot, "aligned": kernel(True), "as_given": kernel(False)}
        row = {"shape": [m, n, k], "layout": layout,
               **time_checked(fns, sets, ref, f"{m}x{n}x{k} {layout}")}
        row["aligned_vs_as_given"] = row["as_given"] / row["aligned"]
        row["aligned_vs_xla"] = row["xla_dot"] / row["aligned"]
        print(f"{m}x{n}x{k} {layout}: xla {row['xla_dot']:.1f} us, aligned {row['aligned']:.1f} us, "
              f"as given {row['as_given']:.1f} us: {row['aligned_vs_as_given']:.3f}x faster, "
              f"{row['aligned_vs_xla']:.3f}x XLA", flush=True)
        rows.append(row)
    write_rows("triton_align.json", rows)


if __name__ == "__main__":
    main()
