"""`gelu_tanh`: jax.nn.gelu(approximate=True)'s values and gradients, with only x saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.models.activations import gelu_tanh


def _reference(x):
    return jax.nn.gelu(x, approximate=True)


def _inputs(dtype, n=4097):
    # Both tails (tanh saturated), the steep middle, and exact zero.
    x = jnp.concatenate([jnp.linspace(-12.0, 12.0, n), jnp.zeros(1)])
    return x.astype(dtype)


def test_values_and_gradients_match_jax_gelu_in_f32():
    x = _inputs(jnp.float32)
    np.testing.assert_allclose(gelu_tanh(x), _reference(x), rtol=1e-6, atol=1e-6)
    got = jax.grad(lambda v: jnp.sum(jnp.sin(v) * gelu_tanh(v)))(x)
    want = jax.grad(lambda v: jnp.sum(jnp.sin(v) * _reference(v)))(x)
    # atol: in the left tail 1 + tanh(...) cancels, where any two op orders differ by ~1e-6.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_second_order_matches():
    # Reverse-over-reverse differentiates the backward rule, which is plain jnp.
    x = _inputs(jnp.float32, 257)
    hess = jax.grad(lambda v: jnp.sum(jax.grad(lambda w: jnp.sum(gelu_tanh(w)))(v)))(x)
    want = jax.grad(lambda v: jnp.sum(jax.grad(lambda w: jnp.sum(_reference(w)))(v)))(x)
    np.testing.assert_allclose(hess, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_is_the_f32_math_rounded_once(dtype):
    x = _inputs(dtype)
    got = gelu_tanh(x)
    assert got.dtype == dtype
    exact = _reference(x.astype(jnp.float32))
    # One rounding of the f32 math: within half an ulp of it, except in the cancelling tail.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), rtol=2.0**-8,
                               atol=1e-6)
    grad = jax.grad(lambda v: jnp.sum(gelu_tanh(v).astype(jnp.float32)))(x)
    assert grad.dtype == dtype
    want = jax.grad(lambda v: jnp.sum(_reference(v)))(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, rtol=1e-2, atol=1e-2)


def test_backward_saves_only_the_input():
    # The point of the function: jax.nn.gelu's autodiff keeps tanh(...) and more next to x.
    x = _inputs(jnp.bfloat16, 1023)
    _, vjp = jax.vjp(gelu_tanh, x)
    saved = [leaf for leaf in jax.tree.leaves(vjp) if getattr(leaf, "size", 0) > 1]
    assert len(saved) == 1 and saved[0].shape == x.shape and saved[0].dtype == x.dtype
    _, vjp_ref = jax.vjp(_reference, x)
    assert sum(leaf.size > 1 for leaf in jax.tree.leaves(vjp_ref)) > 1


def test_under_jit_and_vmap():
    x = jax.random.normal(jax.random.key(0), (3, 5, 7), jnp.float32)
    np.testing.assert_allclose(jax.jit(jax.vmap(gelu_tanh))(x), _reference(x), rtol=1e-6, atol=1e-6)
