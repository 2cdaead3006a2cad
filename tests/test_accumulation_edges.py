"""Edge cases of jaxopt_train.accumulation: `multi_steps` against optax.MultiSteps (complex
and float64 params refused, a non-finite micro-step skipped, a state that can be donated),
and a complex aux of `accumulate_gradients` averaged under combine="mean".

The full-batch references and the HLO checks are in tests/test_accumulation.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxopt_train.accumulation import accumulate_gradients, multi_steps


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
