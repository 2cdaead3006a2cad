"""The plain Flax + optax yardstick of `bench train --compare-plain` against the library's GPT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.bench import plain, train_steps
from jaxopt_train.models import GPT, get_gpt_config
from jaxopt_train.models.flops import gpt_param_count

CFG = get_gpt_config("gpt-tiny", n_layers=2, seq_len=16, dtype=jnp.float32)


def _copy_weights(ours, theirs):
    """The library GPT's weights written into the plain model (same layout, other names)."""
    theirs.wte.embedding.set_value(ours.wte.embedding[...])
    theirs.wpe.embedding.set_value(ours.wpe.embedding[...])
    pairs = [("ln1", "ln1"), ("attn.qkv", "qkv"), ("attn.out", "proj"), ("ln2", "ln2"),
             ("mlp.fc", "fc"), ("mlp.proj", "out")]
    for block_ours, block_theirs in zip(ours.blocks, theirs.blocks):
        for src, dst in pairs:
            a = block_ours
            for part in src.split("."):
                a = getattr(a, part)
            b = getattr(block_theirs, dst)
            for name in ("kernel", "bias", "scale"):
                if getattr(a, name, None) is not None:
                    getattr(b, name).set_value(getattr(a, name)[...])
    theirs.ln_f.scale.set_value(ours.ln_f.scale[...])
    theirs.ln_f.bias.set_value(ours.ln_f.bias[...])
    if theirs.head is not None:
        theirs.head.kernel.set_value(ours.head.kernel[...])


@pytest.mark.parametrize("tied", [True, False])
def test_plain_model_is_the_library_gpt(tied):
    # Same function as models.gpt given the same weights (f32 compute), and the same size,
    # so the bench's MFU formula and the comparison hold for it.
    cfg = get_gpt_config("gpt-tiny", n_layers=2, seq_len=16, dtype=jnp.float32, tie_embeddings=tied)
    ours = GPT(cfg, rngs=nnx.Rngs(0))
    theirs = plain._model(cfg, jnp.float32, "xla", seed=1, compute=jnp.float32)
    n_plain = sum(x.size for x in jax.tree.leaves(nnx.state(theirs, nnx.Param)))
    assert n_plain == gpt_param_count(cfg)
    _copy_weights(ours, theirs)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(theirs(tokens), ours(tokens), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant, dtype", [("mixed", jnp.float32), ("pure", jnp.bfloat16)])
def test_plain_step_is_adamw_on_the_cross_entropy(variant, dtype):
    # One compiled plain step against optax.adamw applied by hand to jax.grad of the loss
    # (jitted too, on one device, so both round the bf16 compute alike).
    cfg = get_gpt_config("gpt-tiny", n_layers=1, seq_len=16)
    mesh = train_steps.data_mesh(jax.devices()[:1])
    runner = plain.build_plain_runner(cfg, 4, plain.plain_run(variant, "xla"), mesh)
    params, opt_state = runner.state
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    graphdef = nnx.graphdef(plain._model(cfg, dtype, "xla", seed=0))
    batch = train_steps.lm_batch(cfg, 4, text=False, seed=0)
    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    with jax.numpy_dtype_promotion("standard"):
        params_host = jax.tree.map(np.asarray, params)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params_host)
        updates, _ = tx.update(grads, tx.init(params_host), params_host)
        expected = optax.apply_updates(params_host, updates)
    (new_params, _), got_loss = runner.step(runner.state)
    tol = 1e-5 if variant == "mixed" else 8e-3  # bf16 params: one ulp is 2**-8 relative
    np.testing.assert_allclose(got_loss, loss, rtol=tol)
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def test_plain_bad_input():
    with pytest.raises(ValueError, match="plain variant 'fp8'; legal values"):
        plain.plain_run("fp8", "xla")
    with pytest.raises(ValueError, match="attention='flash'"):
        plain.plain_run("mixed", "flash")
    mesh = train_steps.data_mesh(jax.devices()[:2])
    with pytest.raises(ValueError, match="global batch 3 does not split over 2 devices"):
        plain.build_plain_runner(CFG, 3, plain.plain_run("mixed", "xla"), mesh)
