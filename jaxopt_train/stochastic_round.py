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
    bf16 drops (`bits16`: uniform in [0, 2**16)), so E[result] = x.

    Adding the bits to the magnitude's low half and truncating rounds away from zero with
    that probability for either sign. Infinities and NaNs stay what they are; a finite
    value within one bf16 step of the largest may round up to infinity, as rounding to
    nearest also may.
    """
    if x.dtype != jnp.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    up = lax.bitcast_convert_type((raw + bits16) & np.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), up, x).astype(jnp.bfloat16)  # exact: low half is zero


def step_seed(state) -> jax.Array:
    """A uint32 seed from the integer scalars of an optimizer state (its step counts), which
    move every step and are the same on every device and shard. A state without counts
    gives a constant seed: the bits then vary only with the values (`element_bits16`)."""
    h = jnp.uint32(0x243F6A88)
    ints = [leaf for leaf in jax.tree.leaves(state)
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.integer) and not jnp.ndim(leaf)]
    for i, count in enumerate(ints):
        h = _mix32(h ^ (lax.convert_element_type(count, jnp.uint32) + np.uint32(i)))
    return h


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
