"""The fused epilogue shared by the kernels and the reference: bias, activation.

Written with primitives every Pallas lowering supports (tanh, exp, max,
arithmetic), so the same function runs inside Mosaic GPU, Mosaic TPU and
interpret-mode kernels and in plain XLA. `gelu` is the tanh approximation
(`jax.nn.gelu`'s default, GPT-2's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(x: jax.Array) -> jax.Array:
    """tanh-approximated GELU, equal to `jax.nn.gelu(x, approximate=True)`."""
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + jnp.tanh(inner))


def gelu_derivative(z: jax.Array) -> jax.Array:
    """d gelu(z) / dz in f32, for any float `z`, written through the sigmoid:
    gelu(z) = z * s with s = sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3), so
    gelu'(z) = s + z s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2).

    One exp and one division per element instead of XLA's rational tanh: the fused MLP's
    backward on an H200 (gpt-1b, 16 fc layers) measured dZ's pass at 132 us against 153 us
    with tanh (fifteenth session). z is clamped to +-1e4, where the derivative is already 1
    or 0 in f32, so that z^2 cannot overflow and no finite input gives NaN.
    """
    z = jnp.clip(z.astype(jnp.float32), -1e4, 1e4)
    z2 = z * z
    s = 1.0 / (1.0 + jnp.exp(-2.0 * _SQRT_2_OVER_PI * z * (1.0 + 0.044715 * z2)))
    return s + z * s * (1.0 - s) * (2.0 * _SQRT_2_OVER_PI) * (1.0 + 3.0 * 0.044715 * z2)


def relu(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, jnp.zeros_like(x))


def silu(x: jax.Array) -> jax.Array:
    # x * sigmoid(x) written with exp: logistic has no lowering rule everywhere.
    return x / (1.0 + jnp.exp(-x))


ACTIVATION_FNS = {"gelu": gelu, "relu": relu, "silu": silu}


def apply_epilogue(acc: jax.Array, bias: jax.Array | None, activation: str | None) -> jax.Array:
    """acc (f32) + bias (broadcast over rows), then the activation, still in f32."""
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    if activation is not None:
        acc = ACTIVATION_FNS[activation](acc)
    return acc
