"""The issue 6 yardstick: a careful plain Flax NNX + optax gpt-1b loop, timed like the bench.

    python tools/probe_plain.py [--variants mixed,pure] [--bursts 3] [--calls 10]   # one GPU
    python tools/probe_plain.py --dry                                               # CPU check

Issue 6 says such a loop reaches about 61% MFU on gpt-1b on one H200 and that the bench's
optimised column must beat it. This script is that loop, written the way a Flax user would
write it and using no jaxopt_train code except the FLOP formula: GPT-2 blocks (pre-LN,
fused qkv with biases, tanh GELU, tied embeddings, vocab 50304) built from
`nnx.Linear`/`nnx.LayerNorm`/`nnx.Embed`, cuDNN attention through
`jax.nn.dot_product_attention`, `optax.adamw`, one `jax.jit` step with donated params and
optimizer state, and optax's integer-label cross-entropy on f32 logits.

  mixed   f32 params, bf16 compute (Flax's `param_dtype=float32, dtype=bfloat16`): f32
          gradients and AdamW moments
  pure    bf16 params and compute, so the gradients and AdamW moments are bf16 too (no
          master weights)

Timing as in `bench train`: warm-up dispatches, then bursts of back-to-back steps with one
sync per burst, median burst; MFU = (6N + 12·L·d·T) FLOPs per token (`models.flops`' formula) over
989 TFLOP/s. Prints one JSON line per variant and writes $OUT/plain_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def build(variant: str, cfg: dict):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    compute = jnp.bfloat16
    param = {"mixed": jnp.float32, "pure": jnp.bfloat16}[variant]
    d, heads, layers = cfg["d_model"], cfg["n_heads"], cfg["n_layers"]
    attention = cfg["attention"]
    std, out_std = 0.02, 0.02 / (2 * layers) ** 0.5

    def dense(d_in, d_out, scale, rngs):
        return nnx.Linear(d_in, d_out, dtype=compute, param_dtype=param,
                          kernel_init=nnx.initializers.normal(scale), rngs=rngs)

    def norm(rngs):
        return nnx.LayerNorm(d, dtype=compute, param_dtype=param, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = norm(rngs), norm(rngs)
            self.qkv, self.proj = dense(d, 3 * d, std, rngs), dense(d, d, out_std, rngs)
            self.fc, self.out = dense(d, 4 * d, std, rngs), dense(4 * d, d, out_std, rngs)

        def __call__(self, x):
            b, t, _ = x.shape
            qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, heads, d // heads)
            y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                             is_causal=True, implementation=attention)
            x = x + self.proj(y.reshape(b, t, d))
            return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(std)
            self.wte = nnx.Embed(cfg["vocab"], d, dtype=compute, param_dtype=param,
                                 embedding_init=init, rngs=rngs)
            self.wpe = nnx.Embed(cfg["seq"], d, dtype=compute, param_dtype=param,
                                 embedding_init=init, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.ln_f = norm(rngs)

        def __call__(self, tokens):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))  # tied head

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = tx.init(params)

    def loss_fn(p, tokens, targets):
        logits = nnx.merge(graphdef, p)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    @jax.jit
    def _step(p, s, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens, targets)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    step = jax.jit(_step, donate_argnums=(0, 1))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return step, params, opt_state, n_params


def time_variant(variant: str, cfg: dict, args) -> dict:
    import jax
    import numpy as np

    step, params, opt_state, n_params = build(variant, cfg)
    rng = np.random.default_rng(0)
    shape = (cfg["batch"], cfg["seq"])
    tokens = jax.device_put(rng.integers(0, cfg["vocab"], shape, dtype=np.int32))
    targets = jax.device_put(rng.integers(0, cfg["vocab"], shape, dtype=np.int32))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens, targets).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        params, opt_state, loss = compiled(params, opt_state, tokens, targets)
    jax.block_until_ready(loss)
    bursts = []
    for _ in range(args.bursts):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            params, opt_state, loss = compiled(params, opt_state, tokens, targets)
        jax.block_until_ready((params, loss))
        bursts.append((time.perf_counter() - t0) / args.calls)
    step_s = statistics.median(bursts)
    # models.flops' formula: 6N + 12*L*d*T, N without the position table (a lookup; the tied
    # token table is the head and counts once).
    n_flops = n_params - cfg["seq"] * cfg["d_model"]
    per_token = 6 * n_flops + 12 * cfg["n_layers"] * cfg["d_model"] * cfg["seq"]
    tflops = per_token * cfg["batch"] * cfg["seq"] / step_s / 1e12
    return {"variant": variant, "params": n_params, "flops_params": n_flops, "step_ms": step_s * 1e3, "tflops": tflops,
            "mfu": tflops / args.peak, "compile_s": compile_s, "loss": float(loss),
            "bursts_ms": [b * 1e3 for b in bursts]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="mixed,pure")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="steps per burst")
    p.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s")
    p.add_argument("--dry", action="store_true", help="CPU: a 2-layer toy, XLA attention")
    args = p.parse_args(argv)
    cfg = dict(d_model=2048, n_heads=16, n_layers=16, seq=1024, vocab=50304, batch=8, attention="cudnn")
    if args.dry:
        cfg = dict(d_model=64, n_heads=4, n_layers=2, seq=32, vocab=256, batch=2, attention="xla")
        args.warmup, args.bursts, args.calls = 1, 2, 2
    rows = []
    for variant in args.variants.split(","):
        row = time_variant(variant, cfg, args)
        rows.append(row)
        print("[plain] " + json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "plain_probe.json"), "w") as f:
        json.dump({"config": cfg, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
