"""Edge cases of jaxopt_train.precision and jaxopt_train.loss_scale: state that changes
shape during a call, Linen variable containers and captured intermediates, the loss-scale
range, optimizer extra args and a loss_scale of the wrong type."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.core import freeze

from jaxopt_train import precision as prec

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


# ----------------------------------------------------------------------------- NNX state that grows


class _Sower(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, "act", y)  # a variable the input state does not have
        return y


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
@pytest.mark.parametrize("policy, act_dtype", [("fp32", F32), ("bf16", BF16)])
def test_nnx_apply_with_sown_intermediates(policy, act_dtype):
    graphdef, state = nnx.split(_Sower(nnx.Rngs(0)))
    x = jnp.ones((2, 3), jnp.float32)
    want = nnx.merge(graphdef, state)(x)
    out, new_state = jax.jit(lambda s, x: prec.nnx_apply_with_state(policy, graphdef, s, x))(state, x)
    np.testing.assert_allclose(out, want, rtol=2e-2)
    assert new_state["lin"]["kernel"][...].dtype == F32  # cast back like the input state
    (act,) = jax.tree.leaves(new_state["act"])  # new: keeps the compute dtype it was sown in
    assert act.dtype == act_dtype and act.shape == (2, 4)
    assert prec.nnx_apply(policy, graphdef, state, x).shape == (2, 4)


# ----------------------------------------------------------------------------- Linen collections


class _Cached(linen.Module):
    @linen.compact
    def __call__(self, x):
        cache = self.variable("cache", "k", lambda: jnp.zeros((2, 4), jnp.bfloat16))
        y = linen.Dense(4)(x)
        cache.value = cache.value + y.astype(cache.value.dtype)
        self.sow("intermediates", "y", y)
        return y


def test_linen_mutable_collections_keep_the_dtype_they_came_in():
    x = jnp.ones((2, 3), jnp.float32)
    variables = _Cached().init(jax.random.key(0), x)
    variables = {"params": variables["params"], "cache": variables["cache"]}
    _, updates = prec.linen_apply("bf16", _Cached(), variables, x, mutable=["cache", "intermediates"])
    assert updates["cache"]["k"].dtype == BF16  # was cast to the param dtype, f32
    # Sown during the call, in the compute dtype: not the param dtype.
    assert updates["intermediates"]["y"][0].dtype == BF16


def test_linen_batch_stats_stay_f32_under_bf16_pure():
    class Norm(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.BatchNorm(use_running_average=False)(linen.Dense(4)(x))

    x = jnp.ones((2, 3), jnp.float32)
    variables = Norm().init(jax.random.key(0), x)
    assert variables["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32
    with jax.numpy_dtype_promotion("standard"):  # BatchNorm mixes bf16 inputs with f32 stats
        _, updates = prec.linen_apply("bf16-pure", Norm(), variables, x, mutable=["batch_stats"])
    assert updates["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32  # was bf16


_SEEN = []  # (param dtype, stats dtype) as _Probe sees them (Linen makes list fields tuples)


class _Probe(linen.Module):
    @linen.compact
    def __call__(self, x):
        stats = self.variable("stats", "s", lambda: jnp.zeros(4, jnp.float32))
        w = self.param("w", linen.initializers.ones, (3, 4), jnp.float32)
        _SEEN.append((w.dtype, stats.value.dtype))
        return x @ w + stats.value.astype(w.dtype)


@pytest.mark.parametrize("container", [dict, freeze], ids=["dict", "FrozenDict"])
def test_linen_apply_casts_only_params_of_any_mapping(container):
    x = jnp.ones((2, 3), jnp.float32)
    variables = _Probe().init(jax.random.key(0), x)
    _SEEN.clear()
    prec.linen_apply("bf16", _Probe(), container(dict(variables)), x)
    assert _SEEN == [(BF16, F32)]  # a FrozenDict had its "stats" cast to bf16 too


def test_linen_capture_intermediates_keep_their_dtype():
    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(2)(linen.Dense(4)(x))

    model, x = Model(), jnp.ones((1, 3), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    out, state = prec.linen_apply("bf16", model, variables, x, capture_intermediates=True)
    assert out.dtype == jnp.float32
    # They were cast to the output dtype (float32) with the outputs.
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(state["intermediates"])}
    assert dtypes == {np.dtype(jnp.bfloat16)}


# ----------------------------------------------------------------------------- loss-scale range


def _unscaled(scale, grads):
    """`scale.unscale(grads)` eagerly, under jit with the scale an argument, and with it a
    compile-time constant (XLA folds 1/scale then)."""
    return [scale.unscale(grads), jax.jit(lambda s, g: s.unscale(g))(scale, grads),
            jax.jit(lambda g: scale.unscale(g))(grads)]


def test_static_unscale_is_exact_at_the_largest_scale():
    scale = prec.StaticLossScale(prec.MAX_LOSS_SCALE)
    grads = {"w": jnp.asarray([0.5, -3.0], jnp.float32) * prec.MAX_LOSS_SCALE}
    for got in _unscaled(scale, grads):
        np.testing.assert_array_equal(got["w"], [0.5, -3.0])


def test_dynamic_growth_stops_at_the_largest_scale_and_unscale_stays_exact():
    scale = prec.DynamicLossScale(initial_scale=2.0**125, growth_interval=1, growth_factor=4.0)
    for _ in range(3):
        scale = jax.jit(lambda s: s.adjust(jnp.asarray(True)))(scale)
        assert float(scale.loss_scale) == prec.MAX_LOSS_SCALE  # 2**127 would unscale to 0
    grads = {"w": jnp.asarray([0.5, -3.0], jnp.float32) * prec.MAX_LOSS_SCALE}
    for got in _unscaled(scale, grads):
        np.testing.assert_array_equal(got["w"], [0.5, -3.0])


@pytest.mark.parametrize("make", [prec.StaticLossScale,
                                  lambda s: prec.DynamicLossScale(initial_scale=s)])
def test_scales_past_the_largest_are_refused(make):
    with pytest.raises(ValueError, match=re.escape("1.18e-38..2**126 (where 1/scale is a normal")):
        make(2.0**127)


@pytest.mark.parametrize("name", ["growth_interval", "hysteresis"])
@pytest.mark.parametrize("bad", [True, np.bool_(True), 0, 2**31, 10**10, 1.5, "3", None])
def test_dynamic_loss_scale_counts_are_ints_in_int32_range(name, bad):
    with pytest.raises(ValueError, match=re.escape(f"{name} >= 1 (an int <= 2**31-1); got")):
        prec.DynamicLossScale(**{name: bad})


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), np.uint8(3), 2**31 - 1])
def test_dynamic_loss_scale_counts_take_numpy_ints_up_to_int32_max(value):
    scale = prec.DynamicLossScale(growth_interval=value, hysteresis=value)
    assert type(scale.growth_interval) is int and scale.growth_interval == value
    assert type(scale.hysteresis) is int and scale.hysteresis == value
    scale = jax.jit(lambda s: s.adjust(jnp.asarray(True)))(scale)  # was an OverflowError at 2**31
    assert int(scale.growth_counter) == 1


# ----------------------------------------------------------------------------- optimizer extra args


def test_apply_updates_if_finite_forwards_extra_args():
    optimizer = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau(accumulation_size=1))
    params = {"w": jnp.ones(3, jnp.float32)}
    step = jax.jit(lambda g, st, p, s, loss: prec.apply_updates_if_finite(
        optimizer, g, st, p, s, value=loss))
    scale, bad = prec.DynamicLossScale(initial_scale=4.0), {"w": jnp.asarray([1.0, jnp.inf, 1.0])}
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int32 counts
        state = optimizer.init(params)
        params, state, scale, finite = step({"w": jnp.full(3, 4.0)}, state, params, scale, 0.25)
        assert bool(finite) and float(state[1].best_value) == 0.25  # the plateau saw value=
        _, skipped, _, finite = step(bad, state, params, scale, 0.125)
    assert not bool(finite) and float(skipped[1].best_value) == 0.25  # skipped step: state kept


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_apply_updates_if_finite_names_a_bad_loss_scale(scale):
    params = {"w": jnp.ones(3, jnp.float32)}
    sgd = optax.sgd(0.1)
    with pytest.raises(TypeError, match=rf"loss_scale={scale!r} must be a NoOpLossScale"):
        prec.apply_updates_if_finite(sgd, params, sgd.init(params), params, scale)


# ----------------------------------------------------------------------------- master weights returned


class _DenseNorm(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def _off_the_bf16_grid(tree):
    # 1 + 2**-12 is an f32 that bf16 (8 mantissa bits) rounds away.
    return jax.tree.map(lambda a: a * (1.0 + 2.0**-12), tree)


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_apply_with_state_returns_the_master_weights_unrounded(jit):
    # The returned state carries the new BatchNorm statistics, so callers feed it to the
    # next step; its Params were the bf16 compute copies cast back to f32, i.e. the
    # master weights rounded to bf16 on every call.
    graphdef, state = nnx.split(_DenseNorm(nnx.Rngs(0)))
    state = nnx.State.merge(_off_the_bf16_grid(state.filter(nnx.Param)), state.filter(nnx.BatchStat))
    x = jax.random.normal(jax.random.key(0), (8, 4), jnp.float32)
    call = lambda s, x: prec.nnx_apply_with_state("bf16", graphdef, s, x)  # noqa: E731
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm promotes bf16 with f32
        _, new_state = (jax.jit(call) if jit else call)(state, x)
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(new_state["linear"][name][...], state["linear"][name][...])
    assert np.abs(new_state["bn"]["mean"][...]).max() > 0  # the statistics did update


def test_linen_apply_mutable_true_returns_the_master_weights_unrounded():
    module = linen.Sequential([linen.Dense(4), linen.BatchNorm(use_running_average=False)])
    x = jax.random.normal(jax.random.key(0), (8, 4), jnp.float32)
    variables = module.init(jax.random.key(1), x)
    variables = {**variables, "params": _off_the_bf16_grid(variables["params"])}
    with jax.numpy_dtype_promotion("standard"):
        _, updates = prec.linen_apply("bf16", module, variables, x, mutable=True)
    jax.tree.map(np.testing.assert_array_equal, updates["params"], variables["params"])
    assert updates["batch_stats"]["layers_1"]["mean"].dtype == F32


# ----------------------------------------------------------------------------- float64 policies


@pytest.mark.parametrize("spec", ["p=f64,c=f32,o=f32", "p=f32,c=float64", "p=f32,c=f32,o=f64"])
def test_float64_policy_needs_x64(spec):
    # Without x64 the casts made float32 arrays (one UserWarning) under a policy that
    # reported float64.
    with pytest.raises(ValueError, match=r"=float64 needs 64-bit JAX.*jax_enable_x64"):
        prec.Policy.from_string(spec)


def test_float64_policy_casts_to_float64_with_x64():
    with jax.enable_x64(True):
        policy = prec.Policy.from_string("p=f64,c=f32,o=f32")
        assert policy.cast_to_param({"w": jnp.ones(2, jnp.float32)})["w"].dtype == np.float64


@pytest.mark.parametrize("make", [lambda: prec.StaticLossScale(2.0**10),
                                  lambda: prec.DynamicLossScale(initial_scale=2.0**10)])
def test_complex_gradients_are_unscaled(make):
    # Complex leaves were left as they came: scaled gradients, a 1024x too large step.
    scale = make()
    params = {"w": jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64), "b": jnp.ones(2, jnp.float32)}

    def loss(p):
        return jnp.sum(jnp.abs(p["w"]) ** 2) + jnp.sum(p["b"] ** 2)
    want = jax.grad(loss)(params)
    got = jax.jit(lambda p: scale.unscale(jax.grad(lambda q: scale.scale(loss(q)))(p)))(params)
    assert got["w"].dtype == jnp.complex64
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
    np.testing.assert_allclose(got["b"], want["b"], rtol=1e-6)
    new, _, _, finite = prec.apply_updates_if_finite(
        optax.sgd(0.1), jax.grad(lambda q: scale.scale(loss(q)))(params),
        optax.sgd(0.1).init(params), params, scale)
    assert bool(finite)
    np.testing.assert_allclose(new["w"], params["w"] - 0.1 * want["w"], rtol=1e-6)
    # An overflow in a complex gradient counts as one: the step is skipped.
    bad = {"w": jnp.asarray([np.inf + 0j, 1j], jnp.complex64), "b": jnp.ones(2, jnp.float32)}
    _, _, _, finite = prec.apply_updates_if_finite(optax.sgd(0.1), bad, optax.sgd(0.1).init(params),
                                                   params, scale)
    assert not bool(finite)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_float64_gradients_are_unscaled_in_float64(dtype):
    # 1/scale was taken in float32: unscaling by 1000 put a 4.7e-8 error on a float64 value.
    with jax.enable_x64(True):
        scale = prec.StaticLossScale(1000.0)
        x = jnp.asarray([1.2345678901234567, 3.0], dtype)
        got = scale.unscale(x * jnp.asarray(1000.0, dtype))  # gradients of the scaled loss
        assert got.dtype == dtype
        np.testing.assert_allclose(got, x, rtol=1e-15)


def test_bf16_params_with_an_optimizer_without_a_step_count_need_a_rounding_seed():
    """optax.sgd keeps no count, so the default seed was constant: 500 steps moved bf16 weights
    by 0.0001 where 0.05 was due. Now refused, and rounding_seed=step rounds without bias."""
    n = 4000  # f32 gradients, all distinct: equal ones draw equal bits, and the mean gets noisier
    params = {"w": jnp.ones(n, jnp.bfloat16)}
    grads = {"w": jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, n), jnp.float32) * 1e-4}
    sgd = optax.sgd(1.0)
    with pytest.raises(ValueError, match=r"state has none.*optax.sgd.*expected a state with a count, "
                                         r"or rounding_seed=<the step number"):
        prec.apply_updates_if_finite(sgd, grads, sgd.init(params), params, prec.NoOpLossScale())
    step = jax.jit(lambda p, i: prec.apply_updates_if_finite(
        sgd, grads, sgd.init(p), p, prec.NoOpLossScale(), rounding_seed=i)[0])
    for i in range(500):
        params = step(params, jnp.uint32(i))
    moved = 1.0 - np.asarray(params["w"], np.float32)
    due = 500 * np.asarray(grads["w"], np.float32)
    np.testing.assert_allclose(moved.mean(), due.mean(), rtol=0.03)  # ~7 standard errors
    # f32 params are updated exactly (nothing to round): no seed needed.
    f32 = {"w": jnp.ones(4, jnp.float32)}
    prec.apply_updates_if_finite(sgd, {"w": jnp.ones(4, jnp.float32)}, sgd.init(f32), f32, prec.NoOpLossScale())
