"""Stochastic rounding of float32 to bfloat16, for optimizer state and params stored in bf16.

Adam's second moment moves by (1 - b2) = 0.1% of itself a step at b2 = 0.999, less
than half of bf16's 0.39% spacing, so rounding to nearest hands back the old value:
the moment stops following the gradients (warming up on gradients of constant size it
stalls at a quarter of its true value, and once they shrink it can no longer decay). Rounding up with probability
equal to the discarded fraction keeps every step's change in expectation.

Parameters stored in bf16 (no f32 master copy) have the same trouble at a larger scale: an
update below half a bf16 step of its weight (lr x ~1 against |w| x 2**-9) is dropped whole,
so late in a decaying schedule rounding to nearest stops training. `apply_updates` rounds
them stochastically too.

The random bits come from a cheap integer hash of each element's new and old values and
a seed from the step counts (`element_bits16`, `step_seed`), which XLA fuses into the
optimizer's elementwise pass: no PRNG state, no extra memory pass, and the same bits
whether a device updates the whole leaf or a ZeRO shard of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

_GOLDEN = np.uint32(0x9E3779B9)


def _mix32(h: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (xor-shift-multiply, "lowbias32" constants): nearby inputs
    give unrelated outputs."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> 16)


def element_bits16(new: jax.Array, old: jax.Array, seed: jax.Array) -> jax.Array:
    """uint32 values in [0, 2**16), one per element: a hash of the element's new value, its
    old value and `seed`.

    Drawn from each element's own values (not its position), so a device updating a shard
    of a leaf draws what the whole leaf's update draws for those elements: ZeRO's sharded
    optimizer step rounds exactly as the replicated one. Over seeds the bits are uniform,
    which is what makes the rounding unbiased.
    """
    a = lax.bitcast_convert_type(new.astype(jnp.float32), jnp.uint32)
    b = lax.bitcast_convert_type(old.astype(jnp.float32), jnp.uint32)
    # The seed is mixed first (one scalar op): a raw step counter xored into `a` flips only
    # its low bits, the very fraction being rounded, so (a ^ seed) repeated across steps and
    # the draws of one weight correlated (updates came out 4.6% long with seeds 0, 1, 2...).
    seed = _mix32(jnp.asarray(seed, jnp.uint32))
    return _mix32(_mix32(a ^ seed) + b * _GOLDEN) >> 16


def stochastic_round_bf16(x: jax.Array, bits16: jax.Array) -> jax.Array:
    """`x` (float32) rounded to bfloat16 up or down, up with the probability of the 16 bits
    bf16 drops (`bits16`: uniform uint32 in [0, 2**16); only their low 16 bits are used, so
    full 32-bit draws such as `jax.random.bits(key, x.shape)` also work), so E[result] = x.

    Adding the bits to the magnitude's low half and truncating rounds away from zero with
    that probability for either sign. Infinities and NaNs stay what they are; a finite
    value within one bf16 step of the largest may round up to infinity, as rounding to
    nearest also may.
    """
    if x.dtype != jnp.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    # Only the low 16 bits may be added: full 32-bit draws (`jax.random.bits`) would carry
    # into the kept half and move x by up to 2**16 bf16 steps (or to inf). Uniform 32-bit
    # bits have uniform low halves, so masking keeps the rounding unbiased.
    bits16 = jnp.asarray(bits16, jnp.uint32) & np.uint32(0xFFFF)
    up = lax.bitcast_convert_type((raw + bits16) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), up, x).astype(jnp.bfloat16)  # exact: low half is zero


def _step_counts(state) -> list:
    return [leaf for leaf in jax.tree.leaves(state)
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.integer) and not jnp.ndim(leaf)]


def has_step_count(state) -> bool:
    """Whether `state` (an optimizer state, or its `jax.eval_shape`) holds an integer scalar
    for `step_seed` to draw on. optax.sgd (with or without momentum) and optax.trace keep none."""
    return bool(_step_counts(state))


def step_seed(state) -> jax.Array:
    """A uint32 seed from the integer scalars of an optimizer state (its step counts), which
    move every step and are the same on every device and shard. A state without counts
    gives a constant seed: the bits then vary only with the values (`element_bits16`), so a
    value that meets the same update again rounds the same way again, and the rounding is
    biased (`has_step_count` tells; `require_step_count` refuses)."""
    h = jnp.uint32(0x243F6A88)
    for i, count in enumerate(_step_counts(state)):
        h = _mix32(h ^ (lax.convert_element_type(count, jnp.uint32) + np.uint32(i)))
    return h


class CountedState(NamedTuple):
    """The state of `with_step_count(inner)` for an `inner` that keeps no step count."""

    inner: Any
    count: jax.Array  # uint32 scalar, +1 per update: what `step_seed` draws on


def with_step_count(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` with a uint32 step count added to its state when that has none (optax.sgd,
    optax.trace), so `step_seed` of the state changes every step; with a count already
    there (Adam's) the state is `inner`'s own. Extra `update` arguments reach `inner`."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        state = inner.init(params)
        return state if has_step_count(state) else CountedState(state, jnp.zeros((), jnp.uint32))

    def update(updates, state, params=None, **extra_args):
        if not isinstance(state, CountedState):
            return inner.update(updates, state, params, **extra_args)
        updates, new = inner.update(updates, state.inner, params, **extra_args)
        return updates, CountedState(new, state.count + np.uint32(1))

    return optax.GradientTransformationExtraArgs(init, update)


def require_step_count(opt_state, params, remedy: str) -> None:
    """Raises ValueError when `params` has bf16 leaves (which `apply_updates` rounds
    stochastically) and `opt_state` has no step count to seed that rounding with.

    With a constant seed a weight meeting the same update twice draws the same bits:
    500 steps of plain optax.sgd moved bf16 weights by 0.0001 where 0.05 was due.
    `remedy` says what the caller can pass instead.
    """
    bf16 = [leaf for leaf in jax.tree.leaves(params) if getattr(leaf, "dtype", None) == jnp.bfloat16]
    if bf16 and not has_step_count(opt_state):
        raise ValueError(
            "bf16 params are rounded stochastically with a seed from the optimizer state's step "
            "count, and this optimizer's state has none (integer scalars: 0; e.g. optax.sgd); "
            f"expected a state with a count, or {remedy}")


# Xored into the step seed for the params, so their bits differ from the moments' bits of the
# same step (those hash other values, but a shared seed is needlessly correlated).
_PARAM_SEED = np.uint32(0x5BD1E995)


def apply_updates(params, updates, seed: jax.Array):
    """`optax.apply_updates`, but bf16 params are updated in f32 and rounded back to bf16
    stochastically (unbiased), so an update smaller than half a bf16 step still moves the
    weight in expectation. Leaves of any other dtype are updated as optax does.

    `seed`: a uint32 that changes every step and is the same on every device, e.g.
    `step_seed(opt_state)`.
    """
    seed = jnp.asarray(seed, jnp.uint32) ^ _PARAM_SEED

    def one(p, u):
        if p is None or jnp.asarray(p).dtype != jnp.bfloat16:
            return optax.apply_updates(p, u)
        new = p.astype(jnp.float32) + jnp.asarray(u).astype(jnp.float32)
        return stochastic_round_bf16(new, element_bits16(new, p, seed))

    return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)
