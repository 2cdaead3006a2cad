"""Numerical agreements across model layouts: a scanned GPT trains like its unrolled copy."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopt_train.models import GPT, get_gpt_config
from jaxopt_train.train.state import default_optimizer

SMALL = dict(n_layers=2, d_model=16, n_heads=2, seq_len=8, vocab_size=32)


def _ones_params(scan_layers):
    """The GPT's parameter tree (names, shapes) holding ones: cheaper than an init."""
    cfg = get_gpt_config("gpt-tiny", scan_layers=scan_layers, **SMALL)
    params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)[1]
    return jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)


def _unstacked(tree):
    tree = dict(tree)
    blocks = tree.pop("blocks")
    tree["blocks"] = {i: jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(SMALL["n_layers"])}
    return tree


def test_default_optimizer_decays_a_scanned_gpt_like_the_unrolled_one():
    # scan_layers stacks each block's bias and LayerNorm scale into [n_layers, d]: still
    # vectors, which AdamW must not decay (GPT-2/nanoGPT), as in the unrolled model.
    optimizer = default_optimizer(lr=0.1, total_steps=1, weight_decay=0.5, clip_norm=0.0)

    def decay_only_update(params):  # zero gradients: only the weight decay moves params
        zeros = jax.tree.map(jnp.zeros_like, params)
        with jax.numpy_dtype_promotion("standard"):
            return optimizer.update(zeros, optimizer.init(params), params)[0]

    scanned = _unstacked(nnx.to_pure_dict(jax.jit(decay_only_update)(_ones_params(True))))
    unrolled = nnx.to_pure_dict(jax.jit(decay_only_update)(_ones_params(False)))
    np.testing.assert_array_equal(scanned["blocks"][1]["ln1"]["scale"], 0.0)
    np.testing.assert_array_equal(scanned["blocks"][0]["attn"]["qkv"]["bias"], 0.0)
    assert float(jnp.abs(scanned["blocks"][0]["attn"]["qkv"]["kernel"]).max()) > 0
    moved = lambda tree: jax.tree.map(lambda u: bool(jnp.any(u != 0)), tree)  # noqa: E731
    assert moved(scanned) == moved(unrolled)
