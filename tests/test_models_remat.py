"""GPTConfig.remat_layers: the remat policy on the first k blocks only (remat_rest on the others)."""

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


@pytest.mark.parametrize("remat,layers,rest", [
    ("dots", 1, "none"), ("full", 2, "none"), ("dots", 0, "none"), ("full", 3, "none"),
    ("full", 1, "dots"), ("dots", 2, "dots_attention"), ("none", 0, "full"),
])
def test_partial_remat_gradients_match_no_remat(remat, layers, rest):
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 61)
    with jax.default_matmul_precision("highest"):
        want_loss, want = _loss_and_grads(small_cfg(), tokens)
        got_loss, got = _loss_and_grads(
            small_cfg(remat=remat, remat_layers=layers, remat_rest=rest), tokens)
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


def test_the_other_blocks_run_remat_rest(capsys):
    """full on 1 block and dots on 2 keeps what dots keeps on 2 blocks, less than none on them."""
    dots = [_saved_count(small_cfg(remat="dots", remat_layers=k), capsys) for k in (0, 3)]
    per_dots_block = (dots[0] - dots[1]) // 3  # what dots drops per block, against none
    full_one = _saved_count(small_cfg(remat="full", remat_layers=1), capsys)
    mixed = _saved_count(small_cfg(remat="full", remat_layers=1, remat_rest="dots"), capsys)
    assert mixed == full_one - 2 * per_dots_block, (dots, full_one, mixed)
    assert mixed > _saved_count(small_cfg(remat="full"), capsys)


@pytest.mark.parametrize("overrides,message", [
    (dict(remat="dots", remat_layers=4), r"remat_layers=4 must be None \(every block\) or an int from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=-1), "from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=1.5), "from 0 to n_layers=3"),
    (dict(remat="dots", remat_layers=True), "from 0 to n_layers=3"),
    (dict(remat_layers=2), "remat_layers=2 names blocks to rematerialise, but remat='none'"),
    (dict(remat="dots", remat_layers=2, scan_layers=True), "needs scan_layers=False"),
    (dict(remat="full", remat_rest="dots"),
     r"remat_rest='dots' is the policy of the blocks past remat_layers, but remat_layers is None"),
    (dict(remat="full", remat_layers=1, remat_rest="most"), r"remat_rest='most'; legal values"),
    (dict(remat="none", remat_layers=0, remat_rest="dots", scan_layers=True),
     r"remat_rest='dots' needs scan_layers=False"),
])
def test_bad_remat_layers_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_cfg(**overrides)


def test_remat_layers_takes_numpy_ints_and_the_scan_extremes():
    assert small_cfg(remat="dots", remat_layers=np.int64(2)).remat_layers == 2
    for layers in (0, 3, None):  # a scan runs one policy: all blocks or none
        cfg = small_cfg(remat="dots", remat_layers=layers, scan_layers=True)
        assert dataclasses.replace(cfg).remat_layers == layers
