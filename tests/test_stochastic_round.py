"""Stochastic rounding of f32 optimizer state to bf16 (`jaxopt_train.stochastic_round`) against the
f32 arithmetic it stands for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.stochastic_round import element_bits16, step_seed, stochastic_round_bf16


def _as_f32(x):
    return np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("value", [1.0 + 2**-10, -(1.0 + 2**-10), 3e-30 * (1 + 2**-11), 7.3e4])
def test_rounding_is_unbiased(value):
    """1 + 2**-10 is an eighth of a bf16 step above 1: an eighth of the draws round up,
    and the mean is the f32 value, where rounding to nearest gives 1 every time."""
    x = jnp.full((200_000,), value, jnp.float32)
    seeds = jnp.arange(200_000, dtype=jnp.uint32)  # one draw per seed: the bits vary with the step
    out = _as_f32(stochastic_round_bf16(x, element_bits16(x, x, seeds)))
    bits = np.array(value, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)  # toward zero
    neighbours = {float(bits.view(np.float32)), float((bits + np.uint32(0x10000)).view(np.float32))}
    assert set(np.unique(out).tolist()) == neighbours  # the two bf16 values around it, no other
    np.testing.assert_allclose(out.mean(), np.float32(value), rtol=2e-4)


def test_representable_and_special_values_are_kept():
    x = jnp.array([0.0, -0.0, 1.0, -2.5, 65280.0, np.inf, -np.inf, np.nan], jnp.float32)
    bits = jnp.full(x.shape, 0xFFFF, jnp.uint32)  # the largest draw: rounds up whenever it can
    out = _as_f32(stochastic_round_bf16(x, bits))
    np.testing.assert_array_equal(out[:7], np.asarray(x)[:7])
    assert np.isnan(out[7])
    with pytest.raises(TypeError, match="takes float32, got bfloat16"):
        stochastic_round_bf16(x.astype(jnp.bfloat16), bits)


def test_bits_are_16_bit_uniform_and_depend_on_the_values_and_the_seed():
    new = jnp.asarray(np.random.default_rng(0).normal(size=(512, 300)), jnp.float32)
    old = jnp.zeros_like(new)
    a = np.asarray(element_bits16(new, old, jnp.uint32(1)))
    assert a.dtype == np.uint32 and a.min() >= 0 and a.max() < 2**16
    np.testing.assert_allclose(a.mean(), (2**16 - 1) / 2, rtol=0.01)
    np.testing.assert_allclose(a.std(), 2**16 / np.sqrt(12), rtol=0.01)
    for other in (element_bits16(new, old, jnp.uint32(2)), element_bits16(new, old + 1.0, jnp.uint32(1)),
                  element_bits16(new + 1.0, old, jnp.uint32(1))):
        assert np.mean(np.asarray(other) == a) < 0.01
    np.testing.assert_array_equal(element_bits16(new, old, jnp.uint32(1)), a)  # deterministic
    # A shard draws what the whole array draws for its elements (ZeRO's sharded update).
    np.testing.assert_array_equal(element_bits16(new[:7, 5:9], old[:7, 5:9], jnp.uint32(1)), a[:7, 5:9])


def test_step_seed_moves_with_the_step_counts_only():
    seeds = {int(step_seed({"count": jnp.int32(t), "mu": jnp.ones(3)})) for t in range(50)}
    assert len(seeds) == 50
    state = {"count": jnp.int32(4), "mu": jnp.ones(3)}
    assert int(step_seed(state)) == int(step_seed({"count": jnp.int32(4), "mu": jnp.zeros(3)}))
    assert int(step_seed((state, {"count": jnp.int32(1)}))) != int(step_seed((state, {"count": jnp.int32(2)})))


def test_a_second_moment_in_bf16_follows_its_f32_value():
    """nu <- 0.999 nu + 0.001 g**2 with g**2 fixed per element, from 0: after 3000 steps nu is
    0.950 g**2 in f32. Rounded to nearest in bf16 each step it stalls at a quarter of that
    (its 0.1% steps are below half of bf16's spacing); rounded stochastically each element
    wanders by a few bf16 steps around its f32 value, and their mean ratio stays within 1%."""
    g2 = jnp.asarray(np.random.default_rng(0).uniform(0.25, 4.0, size=4096), jnp.float32)

    def run(stochastic):
        def body(t, nu):
            wide = 0.999 * nu.astype(jnp.float32) + 0.001 * g2
            if not stochastic:
                return wide.astype(jnp.bfloat16)
            return stochastic_round_bf16(wide, element_bits16(wide, nu, step_seed(t)))
        return _as_f32(jax.jit(lambda nu: jax.lax.fori_loop(0, 3000, body, nu))(
            jnp.zeros(g2.shape, jnp.bfloat16)))

    want = (1 - 0.999**3000) * np.asarray(g2)
    assert np.mean(run(False) / want) < 0.3  # the stall this fixes
    ratio = run(True) / want
    np.testing.assert_allclose(ratio.mean(), 1.0, atol=0.01)
    assert np.abs(ratio - 1).max() < 0.25


def test_adam_moments_kept_in_bf16_follow_adam_in_f32():
    """`low_precision_state(optax.adam(...), "bf16")` against optax.adam in f32: 3000 steps of
    gradients of random sign and a fixed size per element, b2 = 0.999. Its second moment used
    to stall at about a quarter of f32's with bf16's round-to-nearest."""
    import optax

    from jaxopt_train.train.optim import low_precision_state

    rng = np.random.default_rng(0)
    scale = rng.uniform(0.5, 2.0, size=1024)
    grads = jnp.asarray(rng.choice([-1.0, 1.0], size=(3000, 1024)) * scale, jnp.float32)

    def nu_after(opt):
        params = jnp.zeros((1024,), jnp.float32)

        def body(state, g):
            return opt.update(g, state, params)[1], None
        with jax.numpy_dtype_promotion("standard"):  # optax: b1 ** count (float ** int32)
            state, _ = jax.lax.scan(body, opt.init(params), grads)
        return np.asarray(state[0].nu.astype(jnp.float32)), state

    want, _ = nu_after(optax.adam(1e-3, b2=0.999))
    got, state = nu_after(low_precision_state(optax.adam(1e-3, b2=0.999), "bf16"))
    assert state[0].nu.dtype == jnp.bfloat16 and state[0].count.dtype == jnp.int32
    np.testing.assert_allclose(want, (1 - 0.999**3000) * scale**2, rtol=1e-4)
    np.testing.assert_allclose(np.mean(got / want), 1.0, atol=0.01)
    assert np.abs(got / want - 1).max() < 0.25



def _weights(n=8192):
    """bf16 weights spread over [1, 2) (bf16 step 2**-7 there): distinct values draw
    distinct bits, so the mean over them averages the rounding out."""
    return jnp.asarray(1 + np.random.default_rng(0).random(n), jnp.bfloat16)


def test_bf16_params_take_updates_below_half_a_step_in_expectation():
    """1e-4 a step, where half a bf16 step is 39x that: rounded to nearest the weights never
    move; rounded stochastically they move by the f32 sum (0.05 after 500 steps) on average."""
    import optax

    from jaxopt_train.stochastic_round import apply_updates

    w = _weights()
    # Updates of 0.5e-4..1.5e-4 (mean 1e-4): bf16 has only 128 values in [1, 2), and weights
    # equal in value and update would draw equal bits, i.e. be one sample, not many.
    spread = 1e-4 * (0.5 + np.random.default_rng(1).random(w.shape))
    params = {"w": w, "b": jnp.ones((3,), jnp.float32), "none": None}
    updates = {"w": jnp.asarray(spread, jnp.float32), "b": jnp.full((3,), 1e-4, jnp.float32),
               "none": None}

    @jax.jit
    def run(params):
        def step(p, i):
            return apply_updates(p, updates, i.astype(jnp.uint32)), None
        return jax.lax.scan(step, params, jnp.arange(500))[0]

    out = run(params)
    assert out["w"].dtype == jnp.bfloat16 and out["none"] is None
    np.testing.assert_allclose((_as_f32(out["w"]) - _as_f32(w)).mean(), 500 * spread.mean(),
                               rtol=0.02)
    with jax.numpy_dtype_promotion("standard"):  # optax adds the f32 updates to bf16 params
        nearest = jax.jit(lambda p: jax.lax.fori_loop(
            0, 500, lambda i, p: optax.apply_updates(p, updates), p))(params)
    np.testing.assert_array_equal(_as_f32(nearest["w"]), _as_f32(w))  # what it replaces
    np.testing.assert_array_equal(out["b"], nearest["b"])  # f32 leaves as optax's


def test_apply_updates_leaves_other_dtypes_to_optax():
    import optax

    from jaxopt_train.stochastic_round import apply_updates

    params = [jnp.array([1.0, 2.0], jnp.float32), jnp.array([1.0, 3.0], jnp.float16),
              jnp.array([[0.5]], jnp.bfloat16)]
    updates = [jnp.array([0.25, -1e-3], jnp.float32), jnp.array([1e-3, -2.0], jnp.float16),
               jnp.array([[0.25]], jnp.bfloat16)]
    ours, theirs = apply_updates(params, updates, jnp.uint32(7)), optax.apply_updates(params, updates)
    for a, b in zip(ours, theirs):  # (the bf16 sum 0.75 is exact: no rounding to draw)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_apply_updates_if_finite_rounds_bf16_params_stochastically():
    """The library's update (precision.apply_updates_if_finite) with bf16 params and no
    master copy: SGD at lr 1e-4 moves each weight by ~1e-4 a step, which rounding to
    nearest dropped whole. Plain SGD has no step count, so the step is passed as the seed."""
    import optax

    from jaxopt_train.precision import apply_updates_if_finite, loss_scale_for

    opt, w = optax.sgd(1e-4), _weights()
    grads = jnp.asarray(0.5 + np.random.default_rng(1).random(w.shape), jnp.bfloat16)
    scale = loss_scale_for("bf16-pure")

    @jax.jit
    def run(params):
        def step(carry, i):
            p, s = carry
            with jax.numpy_dtype_promotion("standard"):  # optax's Python-float lr
                p, s, _, _ = apply_updates_if_finite(opt, grads, s, p, scale, rounding_seed=i)
            return (p, s), None
        return jax.lax.scan(step, (params, opt.init(params)), jnp.arange(300, dtype=jnp.uint32))[0][0]

    want = -300 * 1e-4 * float(_as_f32(grads).mean())  # where nearest left them as they were
    np.testing.assert_allclose((_as_f32(run(w)) - _as_f32(w)).mean(), want, rtol=0.02)


def _rounded_mean(value, bits):
    x = jnp.full(bits.shape, value, jnp.float32)
    return np.asarray(stochastic_round_bf16(x, bits).astype(jnp.float32), np.float64)


def _neighbours(value):
    low = np.array(value, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return {float(low.view(np.float32)), float((low + np.uint32(0x10000)).view(np.float32))}


@pytest.mark.parametrize("value", [1e-39, -3.3e-40, 1.2e-38, -(1.0 + 2**-12), 3.38e38, -3.38e38])
def test_rounding_is_unbiased_for_subnormals_negatives_and_values_near_the_largest(value):
    """bf16 keeps f32's subnormals; 3.38e38 lies below bf16's largest value (3.3895e38),
    so neither of its neighbours is inf."""
    n = 100_000
    seeds = jnp.arange(n, dtype=jnp.uint32)
    x = jnp.full((n,), value, jnp.float32)
    out = _rounded_mean(value, element_bits16(x, x, seeds))
    assert set(np.unique(out).tolist()) <= _neighbours(value) and np.isfinite(out).all()
    lo, hi = sorted(_neighbours(value))
    p = (np.float32(value) - lo) / (hi - lo)
    # 6 standard errors of a mean of n Bernoulli(p) draws over a step of (hi - lo).
    assert abs(out.mean() - np.float32(value)) <= 6 * (hi - lo) * np.sqrt(p * (1 - p) / n) + 1e-3 * abs(hi - lo)


def test_full_32_bit_draws_round_to_a_neighbour_unbiased():
    """`jax.random.bits` gives uint32 draws over the full range; only their low 16 bits
    may be added, or the carry moved 1 + 2**-10 to values up to 2**16 bf16 steps away."""
    n = 100_000
    value = 1.0 + 2**-10  # an eighth of a bf16 step above 1
    bits = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    out = _rounded_mean(value, bits)
    assert set(np.unique(out).tolist()) == _neighbours(value)
    assert abs(out.mean() - value) < 6 * 2**-7 * np.sqrt(0.125 * 0.875 / n)
    # Same key, same roundings; another key, others.
    np.testing.assert_array_equal(out, _rounded_mean(value, jax.random.bits(jax.random.key(0), (n,), jnp.uint32)))
    assert (out != _rounded_mean(value, jax.random.bits(jax.random.key(1), (n,), jnp.uint32))).any()
