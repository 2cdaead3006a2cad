"""ZeRO edge cases: masked optimizer states, a skip of non-finite updates decided per shard,
collective arguments checked up front, empty parameter trees, counts given as numpy
integers, Python float leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_zero import _flat_mask_loss, _flat_mask_problem

from jaxopt_train.collectives import METHODS as ALL_REDUCE_METHODS
from jaxopt_train.zero import (elementwise_mismatch, gather_leaves, leaf_specs, make_layout,
                               make_zero_step, opt_state_leaf_specs, place_leaves,
                               reduce_scatter_leaves, shard_dim, zero_shardings)

N = 8
LEAF_N = 4


def _mesh(n):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


# Masked optimizer states on the per-leaf layout -------------------------------------------

def _leaf_problem():
    rng = np.random.default_rng(2)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    # w split on dim 0, v on dim 1, odd replicated (no dimension divisible by 4).
    params = {"w": normal(8, 6), "v": normal(6, 8), "odd": normal(3, 5)}
    return params, normal(LEAF_N * 2, 8)


def _leaf_loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["w"] @ params["v"])[:, :3] @ params["odd"]) ** 2)


_MASKED = {
    # Adam on w and odd only: its moments hold MaskedNode() at v (whose gradient passes through).
    "masked": lambda: optax.masked(optax.adam(1e-2), {"w": True, "v": False, "odd": True}),
    # Adam on w and odd, SGD with momentum on v: each inner state masks the other's leaves.
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)},
        {"w": "adam", "v": "sgd", "odd": "adam"}),
}


@pytest.mark.parametrize("name", list(_MASKED))
def test_per_leaf_zero_trains_a_masked_optimizer_like_the_replicated_one(name):
    """Before: opt_state_leaf_specs refused both ('could not match the optimizer state to the
    parameters': the MaskedNode an inner state holds for a skipped leaf is an empty pytree
    where the params have an array)."""
    tx = _MASKED[name]()
    params, batch = _leaf_problem()
    mesh = _mesh(LEAF_N)
    opt_state = tx.init(params)
    param_specs = leaf_specs(params, LEAF_N)
    specs = (param_specs, opt_state_leaf_specs(tx, opt_state, params, param_specs))
    assert elementwise_mismatch(tx, params, LEAF_N, param_specs) is None
    state = place_leaves((params, opt_state), specs, mesh)

    def per_device(state, x):
        shards, opt_state = state
        grads = jax.grad(_leaf_loss)(gather_leaves(shards, param_specs), x)
        grads = jax.tree.map(lambda g: g / LEAF_N, reduce_scatter_leaves(grads, param_specs))
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, shards)
        return optax.apply_updates(shards, updates), opt_state

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")),
                                 out_specs=specs, check_vma=False))

    @jax.jit
    def reference(params, opt_state):
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(jax.grad(_leaf_loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    ref = (params, opt_state)
    for _ in range(3):
        state, ref = jax.block_until_ready(step(state, sharded_batch)), reference(*ref)
    assert jax.tree.map(lambda x: x.sharding.spec, state[0]) == param_specs
    assert np.abs(np.asarray(state[0]["w"]) - np.asarray(params["w"])).max() > 1e-3  # it trained
    assert jax.tree.structure(state[1]) == jax.tree.structure(ref[1])
    # rtol: one element of 48 was 1.6e-5 apart under the suite's XLA CPU emitters (conftest.py)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=1e-6), state, ref)


def test_opt_state_leaf_specs_keeps_masked_nodes_and_still_checks_shapes():
    params = {"w": jnp.zeros((8, 4), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    specs = leaf_specs(params, LEAF_N)
    tx = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    got = opt_state_leaf_specs(tx, tx.init(params), params, specs)
    assert got.inner_state[0].mu == {"w": P("data"), "b": optax.MaskedNode()}
    assert got.inner_state[0].count == P()
    factored = optax.masked(optax.adafactor(1e-3, min_dim_size_to_factor=2), {"w": True, "b": False})
    with pytest.raises(ValueError, match="do not have their parameter's shape"):
        opt_state_leaf_specs(factored, factored.init(params), params, specs)


# A skip of non-finite updates, decided per shard, on the flat layout -----------------------

@pytest.mark.parametrize("stage", [1, 3])
def test_flat_stages_refuse_apply_if_finite_with_the_fix(stage):
    """Before: accepted. Each device decided finiteness on its own slice: with a NaN gradient
    in one slice that device skipped the step and the others applied it, so the params parted
    from the replicated run's (which skips the whole step)."""
    params, _ = _flat_mask_problem()
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    with pytest.raises(ValueError, match=rf"stage={stage} runs the optimizer on each device's 1-D "
                                         r"slice.*optax.apply_if_finite.*NaN in one gradient element "
                                         r"of one shard.*Use stage=0.*per-leaf layout.*skips a "
                                         r"non-finite step on every device alike"):
        make_zero_step(_flat_mask_loss, tx, params, _mesh(N), stage=stage, method="psum")


def test_flat_stage_0_skips_a_nan_step_with_apply_if_finite():
    params, batch = _flat_mask_problem()
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    mesh = _mesh(N)
    zero = make_zero_step(_flat_mask_loss, tx, params, mesh, stage=0, method="psum")
    x, y = np.array(batch[0]), batch[1]
    x[0, 0] = np.nan  # only the first device's rows
    state = zero.init(params)
    state, _ = jax.block_until_ready(zero.step(state, (jnp.asarray(x), y)))
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    state, _ = jax.block_until_ready(zero.step(state, batch))
    assert np.abs(np.asarray(state.params["w"]) - np.asarray(params["w"])).max() > 1e-3


@pytest.mark.parametrize("specs", [None, "per-leaf"])
def test_elementwise_mismatch_nonfinite_probe_tells_apply_if_finite(specs):
    params = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32),
              "c": jnp.zeros((3,), jnp.float32)}
    leaf = None if specs is None else leaf_specs(params, N)
    skipping = optax.apply_if_finite(optax.adam(1e-3), max_consecutive_errors=3)
    assert elementwise_mismatch(skipping, params, N, leaf) is None  # finite gradients only
    assert "NaN in one gradient element of one shard" in elementwise_mismatch(
        skipping, params, N, leaf, nonfinite=True)
    # Elementwise optimizers keep a NaN in its own element: still accepted.
    for tx in (optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9), optax.lion(1e-4),
               optax.chain(optax.zero_nans(), optax.adam(1e-3))):
        assert elementwise_mismatch(tx, params, N, leaf, nonfinite=True) is None


# reduce_scatter_leaves checks its method up front -----------------------------------------

@pytest.mark.parametrize("method", ["bogus", "PSUM", ""])
def test_reduce_scatter_leaves_refuses_an_unknown_method_with_every_leaf_sharded(method):
    """Before: with no replicated leaf the method was never used, so a misspelt one passed."""
    mesh = _mesh(N)
    allowed = str(ALL_REDUCE_METHODS).replace("(", r"\(").replace(")", r"\)")

    def per_device(x):
        return reduce_scatter_leaves({"w": jnp.ones((16, 4))}, {"w": P("data")}, method=method)["w"]

    with pytest.raises(ValueError, match=rf"method={method!r} must be one of {allowed}"):
        jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))(jnp.zeros((16, 4)))


# Empty parameter trees ----------------------------------------------------------------------

_EMPTY = "params: expected at least one array leaf, got an empty tree"


@pytest.mark.parametrize("empty", [{}, [], {"layer": {}}], ids=["dict", "list", "nested"])
def test_empty_params_are_named_as_such(empty):
    """Before: make_layout said 'needs parameters of one floating dtype; got []', and
    elementwise_mismatch per leaf 'scan got no values to scan over'."""
    with pytest.raises(ValueError, match=_EMPTY):
        make_layout(empty, N)
    with pytest.raises(ValueError, match=_EMPTY):
        elementwise_mismatch(optax.adam(1e-3), empty, N)
    with pytest.raises(ValueError, match=_EMPTY):
        elementwise_mismatch(optax.adam(1e-3), empty, N, leaf_specs(empty, N))
    with pytest.raises(ValueError, match=_EMPTY):
        make_zero_step(lambda p, b: 0.0, optax.adam(1e-3), empty, _mesh(N), stage=1)


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
