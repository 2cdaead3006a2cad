"""Low-precision optimizer state: bf16 storage, f32 math, same trajectory within bf16 rounding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxopt_train.train.optim import low_precision_state, state_dtype


def _params():
    key = jax.random.key(0)
    return {"w": jax.random.normal(key, (16, 8), jnp.float32),
            "b": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)}


def _loss(params, x):
    return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def _run(optimizer, steps=20):
    params = _params()
    x = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(_loss)(params, x)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    losses = []
    for _ in range(steps):
        params, state = step(params, state)
        losses.append(float(_loss(params, x)))
    return params, state, np.asarray(losses)


def test_bf16_state_is_stored_in_bf16_and_counts_keep_int():
    opt = low_precision_state(optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1), "bf16")
    _, state, _ = _run(opt, steps=2)
    leaves = jax.tree.leaves(state)
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    ints = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.integer)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    assert ints and all(x.dtype == jnp.int32 for x in ints)
    assert all(int(x) == 2 for x in ints)


def test_bf16_state_follows_the_f32_trajectory():
    make = lambda: optax.adamw(5e-2, b1=0.9, b2=0.95, weight_decay=0.1)  # noqa: E731
    ref_params, _, ref_losses = _run(make())
    params, _, losses = _run(low_precision_state(make(), jnp.bfloat16))
    assert losses[-1] < 0.5 * losses[0]  # it trains
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        # 20 steps of lr 5e-2 with ~0.4% relative error per moment stay within 2e-2.
        np.testing.assert_allclose(got, want, atol=2e-2)


def test_bf16_state_is_built_without_the_f32_state():
    """Only the bf16 moments are allocated: the f32 ones used to be built eagerly and
    freed, which left a hole of their size in the device's memory pool (gpt-1b:
    6.8 GiB) that the train step's temporaries could not use under a 16 GiB cap."""
    params = {"w": jnp.ones((256, 256), jnp.float32), "b": jnp.ones((256,), jnp.float32)}
    opt = low_precision_state(optax.adamw(1e-3), "bf16")
    compiled = opt.init.lower(params).compile()  # the init is jitted
    f32_moments = 2 * sum(x.nbytes for x in jax.tree.leaves(params))
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < f32_moments // 8, memory
    assert memory.output_size_in_bytes <= f32_moments // 2 + 64  # bf16 mu, nu and the count
    state = opt.init(params)
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        optax.adamw(1e-3).init(params))
    jax.tree.map(np.testing.assert_array_equal, state, want)
    assert jax.tree.map(lambda x: x.dtype, state) == jax.tree.map(lambda x: x.dtype, want)


def test_f32_returns_the_inner_transformation():
    inner = optax.sgd(0.1)
    assert low_precision_state(inner, "f32") is inner


@pytest.mark.parametrize("bad", ["fp8", "int8", jnp.int32, jnp.float16])
def test_bad_state_dtype(bad):
    with pytest.raises(ValueError, match="legal values"):
        state_dtype(bad)


def test_bf16_state_forwards_extra_args_to_the_inner_transformation():
    # reduce_on_plateau needs value=loss; the wrapper's update took no extra arguments,
    # so it raised TypeError (and optax.chain around it silently dropped value=).
    inner = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(accumulation_size=1))
    opt = low_precision_state(inner, "bf16")
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    params = _params()
    grads = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
        _, state = opt.update(grads, state, params, value=jnp.asarray(0.25, jnp.float32))
        chain = optax.chain(opt)
        _, chained = chain.update(grads, chain.init(params), params,
                                  value=jnp.asarray(0.5, jnp.float32))
    assert float(state[1].best_value) == 0.25  # the plateau saw value=
    assert float(chained[0][1].best_value) == 0.5


def test_bf16_state_still_wraps_transformations_without_extra_args():
    opt = low_precision_state(optax.sgd(0.1, momentum=0.9), "bf16")
    params = _params()
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = opt.update(params, opt.init(params), params, value=jnp.asarray(1.0))
    jax.tree.map(lambda u, p: np.testing.assert_allclose(u, -0.1 * p, rtol=1e-6), updates, params)


@pytest.mark.parametrize("bad, message", [
    (dict(clip_norm=-1.0), "clip_norm=-1.0 must be"),  # flipped every clipped update's sign
    (dict(clip_norm=float("nan")), "clip_norm=nan must be"),
    (dict(warmup=-5), "warmup=-5 must be"),  # a schedule starting at 0.78 lr, falling
    (dict(warmup=2.5), "warmup=2.5 must be"),
    (dict(lr=float("inf")), "lr=inf must be"),
    (dict(b2=1.0), "b2=1.0 must be in [0, 1)"),  # NaN updates from the first step
    (dict(b1=-0.1), "b1=-0.1 must be in [0, 1)"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be"),
    (dict(total_steps=True), "total_steps=True must be an int >= 1"),  # ran as 1 step
    (dict(lr="3e-4"), "lr='3e-4' must be a number"),  # a bare comparison TypeError
])
def test_default_optimizer_refuses_impossible_settings(bad, message):
    from jaxopt_train.train.state import default_optimizer  # noqa: PLC0415

    with pytest.raises(ValueError, match=re.escape(message)):
        default_optimizer(**{"lr": 1e-2, "total_steps": 10, **bad})



def test_default_optimizer_takes_numpy_ints_and_floats():
    from jaxopt_train.train.state import default_optimizer  # noqa: PLC0415

    opt = default_optimizer(lr=np.float32(1e-2), total_steps=np.int64(10), warmup=np.int32(2))
    params = {"w": jnp.ones((2, 2))}
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        updates, _ = opt.update(params, opt.init(params), params)
    assert np.isfinite(np.asarray(updates["w"])).all()


def test_bf16_state_keeps_every_leafs_dtype_across_updates():
    # With bf16 params, prodigy's and D-Adaptation's scalar estimates are bf16; the update
    # widened them to f32 and left them there, so the state's dtypes changed after one step
    # (the Trainer's select between old and new state, a scan over steps_per_dispatch and a
    # restore into the saved dtypes all failed: "estim_lr has dtype float32; expected bfloat16").
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    for inner in (optax.contrib.prodigy(1.0), optax.contrib.dadapt_adamw(1.0)):
        opt = low_precision_state(inner, "bf16")
        state = opt.init(params)
        with jax.numpy_dtype_promotion("standard"):
            _, new = jax.jit(opt.update)(grads, state, params)
        dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)  # noqa: E731
        assert dtypes(new) == dtypes(state)


@pytest.mark.parametrize("make", [lambda: optax.sgd(1.0, momentum=0.99), lambda: optax.trace(0.999)],
                         ids=["sgd momentum 0.99", "trace 0.999"])
def test_bf16_state_of_an_optimizer_without_a_step_count_follows_f32(make):
    """optax.sgd and optax.trace keep no step count, so the rounding's seed was constant:
    a moment meeting the same values rounded the same way every step, and sgd's momentum
    trace at 0.99 settled at 0.69 of its f32 value (trace(0.999): 0.18)."""
    grads = {"w": jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, 1000), jnp.float32) * 1e-2}

    def final_trace(optimizer):
        params = {"w": jnp.zeros(1000, jnp.float32)}

        def body(state, _):
            return optimizer.update(grads, state, params)[1], None
        state, _ = jax.lax.scan(body, optimizer.init(params), None, length=2000)
        return state

    state = final_trace(low_precision_state(make(), "bf16"))
    want = jax.tree.leaves(final_trace(make()))[0]
    assert int(state.count) == 2000 and state.count.dtype == jnp.uint32
    got = jax.tree.leaves(state.inner)[0]
    assert got.dtype == jnp.bfloat16
    ratio = np.asarray(got, np.float32) / np.asarray(want)
    # Unbiased: the mean is on target; each element wanders by its rounding noise (a few %
    # at 0.999, which averages ~1000 steps of it).
    assert abs(ratio.mean() - 1) < 5e-3 and np.abs(ratio - 1).max() < 0.1, (ratio.mean(), ratio.min())


def test_a_step_count_is_added_only_where_the_state_has_none():
    params = _params()
    adam = low_precision_state(optax.adam(1e-3), "bf16").init(params)
    assert jax.tree.structure(adam) == jax.tree.structure(optax.adam(1e-3).init(params))
