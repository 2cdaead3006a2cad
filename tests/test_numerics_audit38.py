"""Numerics audit of loss scaling, stochastic rounding and MultiSteps accumulation against
references: a Python loss-scale state machine (Megatron-LM's rules), the mean of many
stochastic roundings, optax.MultiSteps and the plain mean of the micro-step gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import multi_steps
from jaxopt_train.loss_scale import MAX_LOSS_SCALE, DynamicLossScale
from jaxopt_train.precision import all_finite
from jaxopt_train.stochastic_round import element_bits16, stochastic_round_bf16

# ----------------------------------------------------------------------------- loss scale


def _reference_scales(flags, initial, interval, growth, backoff, hysteresis, minimum):
    """Megatron-LM's DynamicGradScaler.update, in float32, with the scale capped at 2**126."""
    scale, counter, left, out = np.float32(initial), 0, hysteresis, []
    for finite in flags:
        if finite:
            counter += 1
            if counter == interval:
                counter, left = 0, hysteresis
                with np.errstate(over="ignore"):  # inf lands on the cap, as in adjust
                    scale = min(scale * np.float32(growth), np.float32(MAX_LOSS_SCALE))
        else:
            counter, left = 0, left - 1
            if left <= 0:
                scale = max(scale * np.float32(backoff), np.float32(minimum))
        out.append(float(scale))
    return out


@pytest.mark.parametrize("config", [(2.0**15, 3, 2.0, 0.5, 2, 1.0), (1000.0, 1, 3.0, 0.3, 1, 7.0),
                                    (5.0, 4, 1.5, 0.25, 3, 0.1), (2.0**120, 2, 4.0, 0.5, 1, 1.0)])
def test_dynamic_loss_scale_follows_the_reference_state_machine(config):
    flags = np.random.default_rng(0).random(200) < 0.75
    scale, got = DynamicLossScale(*config), []

    @jax.jit
    def run(scale, flags):
        def body(s, f):
            s = s.adjust(f)
            return s, s.loss_scale
        return jax.lax.scan(body, scale, flags)

    scale, got = run(scale, jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(got), _reference_scales(flags, *config))
    assert int(scale.skipped_steps) == int((~flags).sum())


def test_devices_agree_on_an_overflow_seen_by_one_of_them():
    """Under shard_map the finiteness of the reduced gradients is one flag for all devices:
    inf on one device and nan on another both back the scale off everywhere, and the
    scale stays invariant (out_specs=P() is accepted)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def step(scale, grads):
        grads = jax.lax.psum(scale.unscale(grads), "data")
        return scale.adjust(all_finite(grads))

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    grads = jnp.ones((8, 4)).at[3, 1].set(jnp.inf).at[6, 0].set(jnp.nan)
    new = run(DynamicLossScale(hysteresis=1), jax.device_put(grads, NamedSharding(mesh, P("data"))))
    assert float(new.loss_scale) == 2.0**14 and int(new.skipped_steps) == 1


def test_int_bool_and_empty_leaves_pass_through_scale_and_unscale():
    scale = DynamicLossScale(initial_scale=3.0)
    tree = {"empty": jnp.ones((0, 3)), "ints": jnp.arange(3), "flags": jnp.array([True, False]),
            "half": jnp.full((2,), 3.0, jnp.float16)}
    scaled = scale.scale(tree)
    assert scaled["half"].dtype == jnp.float32 and float(scaled["half"][0]) == 9.0
    back = scale.unscale(tree)
    np.testing.assert_array_equal(back["ints"], tree["ints"])
    np.testing.assert_array_equal(back["flags"], tree["flags"])
    assert back["empty"].shape == (0, 3) and bool(all_finite(back))

# ----------------------------------------------------------------------------- stochastic rounding


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

# ----------------------------------------------------------------------------- MultiSteps


def _run(optimizer, params, micro_grads):
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for g in micro_grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_multi_steps_refuses_complex_params():
    """optax.MultiSteps' float32 accumulator dropped the imaginary part of every micro-step
    but the last (the mean of 1j and 3j came out 1.5j): refused at init, naming the leaf."""
    params = {"c": jnp.array([1 + 1j, 2 - 1j], jnp.complex64), "r": jnp.array([1.0, 2.0])}
    with pytest.raises(ValueError, match=r"at most 32-bit real dtypes, got .*\['c'\]: complex64"):
        multi_steps(optax.sgd(1.0), 2).init(params)


def test_multi_steps_refuses_float64_params():
    with jax.enable_x64(True):
        params = {"w": jnp.array([1.0, -2.0], jnp.float64)}
        with pytest.raises(ValueError, match="float64.*accumulate_gradients"):
            multi_steps(optax.sgd(1.0), 2).init(params)


@pytest.mark.parametrize("every_k", [1, 3])
def test_multi_steps_matches_optax_multisteps_on_real_params(every_k):
    """f32 and bf16 params with Adam, a non-finite micro-step in the middle: the same
    updates and state as optax.MultiSteps with skip_not_finite."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(3,)), jnp.bfloat16)}
    micro = [jax.tree.map(lambda p, i=i: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
             for i in range(3 * every_k)]
    micro.insert(2, jax.tree.map(lambda g: g.at[0].set(jnp.inf), micro[0]))
    reference = optax.MultiSteps(optax.adam(0.1), every_k, should_skip_update_fn=optax.skip_not_finite)
    with jax.numpy_dtype_promotion("standard"):
        want, want_state = _run(reference.gradient_transformation(), params, micro)
    got, state = _run(multi_steps(optax.adam(0.1), every_k), params, micro)
    for key in params:
        # Up to an ulp: XLA fuses the two programs' Adam arithmetic differently.
        np.testing.assert_allclose(np.asarray(got[key], np.float32), np.asarray(want[key], np.float32),
                                   rtol=1e-6 if got[key].dtype == jnp.float32 else 1e-2)
    assert int(state.mini_step) == int(want_state.mini_step)
    assert int(state.gradient_step) == int(want_state.gradient_step) == 3
    assert int(state.skip_state["num_not_finite"]) == int(want_state.skip_state["num_not_finite"])


def test_multi_steps_state_can_be_donated():
    """Each counter of the state is its own buffer: a jit that donates the state ran into
    "Attempt to donate the same buffer twice" when both counters were one zeros array."""
    optimizer = multi_steps(optax.sgd(0.1), 2)
    params = {"w": jnp.ones(3)}
    update = jax.jit(optimizer.update, donate_argnums=1)
    state = optimizer.init(params)
    for _ in range(2):
        _, state = update({"w": jnp.ones(3)}, state, params)
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
