"""Audit regressions: precision, accumulation and ZeRO edge cases."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxopt_train import precision as prec
from jaxopt_train.accumulation import accumulate_gradients
from jaxopt_train.zero import (elementwise_mismatch, leaf_specs, make_layout, make_zero_step,
                               shard_dim, zero_shardings)


def test_zero_counts_take_numpy_integers():
    # np.int64(4) was refused as "num_shards=np.int64(4) must be a positive int".
    params = {"w": jnp.ones((16, 3), jnp.float32)}
    layout = make_layout(params, np.int64(4))
    assert layout.num_shards == 4 and type(layout.num_shards) is int
    assert shard_dim((8, 6), np.int64(4)) == 0
    assert leaf_specs(params, np.int32(4)) == {"w": P("data")}
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params_sharding, _ = zero_shardings(params, optax.sgd(0.1).init(params), mesh, stage=np.int64(3))
    assert params_sharding["w"].spec == P("data")
    with pytest.raises(ValueError, match=r"num_shards=np.True_ must be a positive int"):
        make_layout(params, np.True_)


def test_elementwise_mismatch_checks_num_shards():
    params = {"w": jnp.ones((16, 3), jnp.float32)}
    # With per-leaf specs, 0 shards failed with a ZeroDivisionError.
    with pytest.raises(ValueError, match=r"num_shards=0 must be a positive int"):
        elementwise_mismatch(optax.adam(1e-3), params, 0, leaf_specs(params, 8))


def test_flat_zero_takes_python_float_leaves():
    # optax takes a Python float leaf; make_layout failed with AttributeError: no .dtype.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)}
    params = {"w": jnp.asarray(rng.normal(size=(3, 1)), jnp.float32), "k": 1.5}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] * p["k"] - b["y"]) ** 2)

    tx = optax.sgd(0.1)
    with jax.numpy_dtype_promotion("standard"):
        grads = jax.grad(loss)(params, batch)
        want = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    zero = make_zero_step(loss, tx, params, mesh, stage=1, method="psum")
    state, _ = zero.step(zero.init(params), batch)
    for name in want:
        np.testing.assert_allclose(state.params[name], want[name], rtol=1e-6)


def test_complex_aux_is_averaged_under_mean():
    params = {"w": jnp.asarray([0.5, -1.0, 2.0], jnp.float32)}
    batch = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)

    def loss(p, x):
        z = x @ p["w"]
        return jnp.mean(z**2), {"phase": jnp.mean(jnp.exp(1j * z.astype(jnp.complex64)))}

    (_, want), _ = jax.value_and_grad(loss, has_aux=True)(params, batch)
    (_, aux), _ = jax.jit(accumulate_gradients(loss, 4, has_aux=True))(params, batch)
    # It was summed: 4 times the full batch's mean.
    assert aux["phase"].dtype == jnp.complex64
    np.testing.assert_allclose(aux["phase"], want["phase"], rtol=1e-5)


def test_linen_capture_intermediates_keep_their_dtype():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.Dense(4)(x))

    model, x = Model(), jnp.ones((1, 3), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    out, state = prec.linen_apply("bf16", model, variables, x, capture_intermediates=True)
    assert out.dtype == jnp.float32
    # They were cast to the output dtype (float32) with the outputs.
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(state["intermediates"])}
    assert dtypes == {np.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_apply_updates_if_finite_names_a_bad_loss_scale(scale):
    params = {"w": jnp.ones(3, jnp.float32)}
    sgd = optax.sgd(0.1)
    with pytest.raises(TypeError, match=rf"loss_scale={scale!r} must be a NoOpLossScale"):
        prec.apply_updates_if_finite(sgd, params, sgd.init(params), params, scale)
