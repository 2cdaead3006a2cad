"""GPTConfig.remat_layers: the remat policy on the first k blocks only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxopt_train.models import GPT, get_gpt_config, gpt_loss

SMALL = dict(n_layers=3, d_model=32, n_heads=4, seq_len=16, vocab_size=61)


def small_cfg(**overrides):
    return get_gpt_config("gpt-tiny", **{**SMALL, **overrides})


def _loss_and_grads(cfg, tokens):
    model = GPT(cfg, rngs=nnx.Rngs(3))
    return nnx.jit(nnx.value_and_grad(lambda m: gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])))(model)


@pytest.mark.parametrize("remat,layers", [("dots", 1), ("full", 2), ("dots", 0), ("full", 3)])
def test_partial_remat_gradients_match_no_remat(remat, layers):
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 61)
    with jax.default_matmul_precision("highest"):
        want_loss, want = _loss_and_grads(small_cfg(), tokens)
        got_loss, got = _loss_and_grads(small_cfg(remat=remat, remat_layers=layers), tokens)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 nnx.to_pure_dict(got), nnx.to_pure_dict(want))


def _saved_count(cfg, capsys) -> int:
    """How many activations (not arguments) the backward keeps from the forward."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)
    capsys.readouterr()
    with jax.numpy_dtype_promotion("standard"):
        print_saved_residuals(lambda s: gpt_loss(nnx.merge(graphdef, s)(tokens), tokens), state)
    return sum("from the argument" not in line for line in capsys.readouterr().out.splitlines())


def test_each_block_left_out_of_remat_keeps_its_activations(capsys):
    """Saved activations fall block by block from remat_layers=0 ("none") to 3 (all)."""
    counts = [_saved_count(small_cfg(remat="full", remat_layers=k), capsys) for k in range(4)]
    assert counts[0] == _saved_count(small_cfg(), capsys)
    assert counts[3] == _saved_count(small_cfg(remat="full"), capsys)
    steps = np.diff(counts)
    assert np.all(steps < 0) and len(set(steps.tolist())) == 1, counts  # one block's worth each


@pytest.mark.parametrize("overrides,message", [
    (dict(remat="dots", remat_layers=4), r"remat_layers=4 must be None \(every block\) or an int from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=-1), "from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=1.5), "from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=True), "from 0 to n_layers=3"),
    (dict(remat_layers=2), "remat_layers=2 names blocks to rematerialise, but remat='none'"),
    (dict(remat="dots", remat_layers=2, scan_layers=True), "needs scan_layers=False"),
])
def test_bad_remat_layers_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_cfg(**overrides)


def test_remat_layers_takes_numpy_ints_and_the_scan_extremes():
    assert small_cfg(remat="dots", remat_layers=np.int64(2)).remat_layers == 2
    for layers in (0, 3, None):  # a scan runs one policy: all blocks or none
        cfg = small_cfg(remat="dots", remat_layers=layers, scan_layers=True)
        assert dataclasses.replace(cfg).remat_layers == layers
