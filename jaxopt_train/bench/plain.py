"""The yardstick row of `bench train --compare-plain`: a careful plain Flax NNX + optax GPT loop.

Issue 6 asks that the optimised column beat what a careful user gets without this
library, not only the f32 host-loop baseline. This module is that user's loop,
written the usual way and sharing nothing with the library's model or step: the
same GPT-2 layout as `models.gpt` (pre-LN blocks, fused qkv, biases, tanh GELU,
tied head), built from `nnx.Linear` / `nnx.LayerNorm` / `nnx.Embed`, attention
through `jax.nn.dot_product_attention`, `optax.adamw` with the bench's
hyper-parameters, `optax.softmax_cross_entropy_with_integer_labels` on f32 logits,
and one `jax.jit` step with donated params and optimizer state. On several devices
the batch is sharded and the params replicated, and XLA inserts the gradient
all-reduce (plain `jit` data parallelism).

Two variants:
  "mixed": f32 params, bf16 compute (Flax's `param_dtype` / `dtype`); gradients and
           AdamW moments in f32;
  "pure":  bf16 params and compute, so gradients and moments are bf16 too: no f32
           master weights, which the optimised config keeps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.bench.train_steps import AXIS, Runner, lm_batch
from jaxopt_train.models.gpt import GPTConfig

VARIANTS = ("mixed", "pure")
NAMES = {"mixed": "plain Flax+optax, f32 master", "pure": "plain Flax+optax, bf16 params"}
_PARAM_DTYPES = {"mixed": jnp.float32, "pure": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class PlainRun:
    """Stands where `train_steps.RunConfig` does in `Bench.measure` (name, describe, attention)."""

    name: str
    variant: str
    attention: str

    def describe(self) -> dict[str, Any]:
        return {"plain": self.variant, "param_dtype": np.dtype(_PARAM_DTYPES[self.variant]).name,
                "compute_dtype": "bfloat16", "attention": self.attention}


def plain_run(variant: str, attention: str) -> PlainRun:
    if variant not in VARIANTS:
        raise ValueError(f"plain variant {variant!r}; legal values: {VARIANTS}")
    if attention not in ("xla", "cudnn"):
        raise ValueError(f"attention={attention!r}; the plain loop takes 'xla' or 'cudnn'")
    return PlainRun(NAMES[variant], variant, attention)


def _model(cfg: GPTConfig, param_dtype, attention: str, seed: int, compute=jnp.bfloat16) -> nnx.Module:
    # `compute` is bf16 in the bench; the tests build it in f32 to compare with models.gpt.
    d, heads = cfg.d_model, cfg.n_heads
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5

    def dense(d_in, d_out, scale, rngs):
        return nnx.Linear(d_in, d_out, use_bias=cfg.use_bias, dtype=compute, param_dtype=param_dtype,
                          kernel_init=nnx.initializers.normal(scale), rngs=rngs)

    def norm(rngs):
        return nnx.LayerNorm(d, epsilon=cfg.layer_norm_epsilon, dtype=compute,
                             param_dtype=param_dtype, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = norm(rngs), norm(rngs)
            self.qkv, self.proj = dense(d, 3 * d, std, rngs), dense(d, d, out_std, rngs)
            self.fc, self.out = dense(d, cfg.mlp_dim, std, rngs), dense(cfg.mlp_dim, d, out_std, rngs)

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
            self.wte = nnx.Embed(cfg.vocab_size, d, dtype=compute, param_dtype=param_dtype,
                                 embedding_init=init, rngs=rngs)
            self.wpe = nnx.Embed(cfg.seq_len, d, dtype=compute, param_dtype=param_dtype,
                                 embedding_init=init, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.n_layers)])
            self.ln_f = norm(rngs)
            self.head = None if cfg.tie_embeddings else nnx.Linear(  # models.gpt: no bias
                d, cfg.vocab_size, use_bias=False, dtype=compute, param_dtype=param_dtype,
                kernel_init=init, rngs=rngs)

        def __call__(self, tokens):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            return self.wte.attend(x) if self.head is None else self.head(x)

    return Model(nnx.Rngs(seed))


def build_plain_runner(cfg: GPTConfig, global_batch: int, run: PlainRun, mesh, *, seed: int = 0,
                       text: bool = False):
    """Initialises, stages one batch for and compiles the plain loop (`train_steps.Runner`).

    The whole global batch goes through one step (a plain loop has no accumulation).
    ``text``: byte windows of the embedded corpus instead of uniform random ids, as
    the bench's own rows (`train_steps.lm_batch`)."""
    if global_batch % mesh.devices.size:
        raise ValueError(f"global batch {global_batch} does not split over {mesh.devices.size} devices")
    param_dtype = _PARAM_DTYPES[run.variant]
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _model(cfg, param_dtype, run.attention, seed)))
    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)  # the bench's AdamW

    def init():
        params = nnx.state(_model(cfg, param_dtype, run.attention, seed))
        return params, tx.init(params)

    replicated = NamedSharding(mesh, P())
    state = jax.jit(init, out_shardings=replicated)()
    batch = lm_batch(cfg, global_batch, text=text, seed=seed)
    batch = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]).mean()

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(replicated, replicated))
    start = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):  # jax.nn's attention mixes bf16 and f32 constants
        compiled = jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    return Runner(lambda s: compiled(s, batch), state, [compiled], compile_s, 1)
