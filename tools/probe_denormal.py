"""Is an elementwise Adam-like update slower on subnormal f32 inputs on this GPU?

Twenty-ninth session: the trainer's gpt-124m step went from 0.044 to 0.088 s over 800 steps
(same with 10 steps per dispatch, so not the host) at steady clocks and 100% utilisation. A
guess: the moments of vocabulary rows the byte-level data never uses decay into subnormals,
where IEEE sqrt and division (XLA's default, no flush-to-zero) take a slow path. This times
m / (sqrt(v) + eps) over 64M elements with v normal and with v subnormal, in one process;
run it again with XLA_FLAGS=--xla_gpu_ftz=true to compare.

    python3 tools/probe_denormal.py
"""

import json
import time

import jax
import jax.numpy as jnp


def update(m, v):
    return m / (jnp.sqrt(v) + 1e-8), 0.999 * v + 0.001 * m * m


def main():
    n = 64 * 1024 * 1024
    f = jax.jit(update)
    m = jnp.full((n,), 1e-3, jnp.float32)
    out = {}
    for name, value in (("normal", 1e-6), ("subnormal", 1e-40), ("normal_again", 1e-6)):
        v = jnp.full((n,), value, jnp.float32)
        jax.block_until_ready(f(m, v))
        start = time.perf_counter()
        for _ in range(50):
            r = f(m, v)
        jax.block_until_ready(r)
        out[name] = (time.perf_counter() - start) / 50 * 1e3
    print(json.dumps({k: round(x, 3) for k, x in out.items()}), "ms per call")


if __name__ == "__main__":
    main()
