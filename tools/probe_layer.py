"""Where does the bias+GELU layer's forward + backward spend its time? A one-GPU diagnostic.

    python tools/probe_layer.py [--shape M,N,K] [--calls 10]   # JSON at $OUT/layer_probe.json

`bench matmul`'s layer table (fourteenth session) timed gelu(A @ B + bias) forward and
backward at gpt-1b's fc shape: XLA 1.505 ms, our kernel 2.02 ms recomputing Z and 2.04 ms
keeping it. The three products alone run at ~1.1 ms in our kernel, so the gap is outside
them. This traces each variant of that same jitted function (`bench.matmul._layer_fn`) and
lists its GPU kernels with their time per call, and saves each variant's optimised HLO.
Call 3 (tools/gpu_session14b.sh, commit 9d0ca90) also had a `+f32` row: the kept Z's GELU
derivative in f32, as before that commit. The switch it used has since been removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _unfused_layer(name, cotangent):
    import jax

    from jaxopt_train.bench.matmul import with_backward
    from jaxopt_train.kernels import matmul

    kernel = name.removesuffix("+xla_gelu")

    def layer(a, b, bias):
        z = matmul(a, b, backend=kernel)
        return jax.nn.gelu(z + bias.astype(z.dtype), approximate=True)

    return with_backward(layer, cotangent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192,8192,2048", help="M,N,K")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="keep calling for this many seconds before the trace: the step runs at "
                        "the power-capped clock, which a 30-call warm-up does not reach (the "
                        "fifteenth session's 183 us layer pass took 219 us in the step)")
    p.add_argument("--variants",
                   default="xla_dot,mosaic_gpu+xla_gelu,mosaic_gpu,mosaic_gpu+saved",
                   help="bench.matmul layer backends; <kernel>+xla_gelu: the plain kernel product "
                        "with XLA's bias + GELU (the unfused model's MLP)")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxopt_train.bench import matmul as bench
    from probe_gpt1b import summarise_trace

    out_dir = os.environ.get("OUT", ".")
    m, n, k = (int(x) for x in args.shape.split(","))
    sets = bench._input_sets(m, n, k, jnp.bfloat16, 2)
    cotangent = jax.random.normal(jax.random.key(1), (m, n), jnp.float32).astype(jnp.bfloat16)
    rows = []
    for name in args.variants.split(","):
        fn = _unfused_layer(name, cotangent) if name.endswith("+xla_gelu") else \
            bench._layer_fn(name, cotangent)
        compiled = fn.lower(*sets[0]).compile()
        with open(os.path.join(out_dir, f"hlo_layer_{name.replace('+', '_')}.txt"), "w") as f:
            f.write(compiled.as_text())
        # Warm-up: at least 30 calls (compile included in the first), and --warmup-s seconds.
        deadline, i = time.perf_counter() + args.warmup_s, 0
        while i < 30 or time.perf_counter() < deadline:
            jax.block_until_ready(fn(*sets[i % 2]))
            i += 1
        logdir = os.path.join("/tmp", "trace_layer_" + name.replace("+", "_"))
        with jax.profiler.trace(logdir):
            for i in range(args.calls):
                out = fn(*sets[i % 2])
            jax.block_until_ready(out)
        prof = summarise_trace(logdir, args.calls)
        if "error" in prof:  # no trace written: say so, go on with the next variant
            print(f"== {name}: {prof['error']}")
            rows.append({"variant": name, "error": prof["error"]})
            continue
        row = {"variant": name, "busy_ms": prof.get("busy_ms_per_step"),
               "span_ms": prof.get("span_ms_per_step"), "kernels": prof.get("all_kernels"),
               "ops": prof.get("top_ops_ms_per_step")}
        rows.append(row)
        print(f"== {name}: busy {row['busy_ms']:.3f} ms, span {row['span_ms']:.3f} ms per call")
        for kname, ms, calls in row["kernels"] or []:
            print(f"   {ms:8.3f} ms  x{calls:4.1f}  {kname}")
        for oname, ms in row["ops"] or []:
            print(f"   op {ms:8.3f} ms  {oname}")
    with open(os.path.join(out_dir, "layer_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
