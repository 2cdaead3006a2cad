"""Optimizer state stored in a low-precision dtype (bf16 Adam moments).

AdamW keeps two f32 moments per parameter: for a 0.9B-parameter model that is
7.3 GB, more than the f32 weights themselves, and the update reads and writes
both every step. Storing them in bf16 halves that memory and traffic. bf16
keeps f32's exponent range, so the second moment (squares of small gradients)
neither underflows nor overflows; what it loses is mantissa (about 3 significant
digits), which the update tolerates because each step's math still runs in f32:
the state is widened before `inner.update` and narrowed after it. MaxText and
optax's own `mu_dtype` apply the same idea to the first moment; this wrapper
covers every floating leaf of any optax state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_train.loss_scale import is_floating_array
from jaxopt_train.precision import cast_floating
from jaxopt_train.stochastic_round import (element_bits16, step_seed, stochastic_round_bf16,
                                           with_step_count)

STATE_DTYPES = ("f32", "bf16")  # the names the CLIs offer
_STATE_DTYPES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16,
                 "bfloat16": jnp.bfloat16}


def state_dtype(name: str | Any) -> jnp.dtype:
    """`jnp.dtype` of an optimizer-state dtype name ("f32" or "bf16")."""
    if isinstance(name, str):
        if name.lower() not in _STATE_DTYPES:
            raise ValueError(f"optimizer state dtype {name!r}; legal values: {sorted(_STATE_DTYPES)}")
        return jnp.dtype(_STATE_DTYPES[name.lower()])
    dtype = jnp.dtype(name)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"optimizer state dtype {dtype}; legal values: float32, bfloat16")
    return dtype


def low_precision_state(inner: optax.GradientTransformation, dtype: Any = jnp.bfloat16
                        ) -> optax.GradientTransformation:
    """`inner` with its floating state stored in `dtype` between steps.

    Integer leaves (step counts) and floating scalars keep their dtype: a scalar
    is a hyperparameter or a statistic (optax.inject_hyperparams' b2=0.999 rounds
    to 1.0 in bf16, and Adam's bias correction then divides by zero), and costs
    nothing to keep wide. Updates are computed in f32 from the widened state, so
    only storage precision changes, and the new state is rounded to bf16
    stochastically (unbiased: a moment whose per-step change is below half a bf16
    step still moves, in expectation, as in f32), with bits hashed from the step
    counts and each element's new and old values: the same inputs give the same
    state, on a ZeRO shard as on the whole leaf. An `inner` whose state has no step count
    (optax.sgd) gets one (`stochastic_round.with_step_count`). With ``dtype=float32`` this
    returns `inner` unchanged.

    Args:
      inner: any optax transformation, e.g. `optax.adamw(...)`; extra arguments of
        `update` (e.g. `value=loss`) are passed on to it.
      dtype: "bf16"/"f32" or a dtype.
    """
    dtype = state_dtype(dtype)
    if dtype == jnp.float32:
        return inner
    # Extra arguments (reduce_on_plateau's value=loss) reach `inner`; one that takes none
    # ignores them, as it would inside optax.chain. A state without a step count gets one:
    # with a constant seed a moment meeting the same values rounded the same way every step
    # (optax.sgd's momentum trace at 0.99 settled at 0.69 of its f32 value).
    inner = with_step_count(inner)

    # Jitted, so the wide state is never materialised: eagerly, inner.init allocated
    # f32 moments (gpt-1b: 6.8 GiB) next to the params, the narrow copies landed after
    # them, and freeing the f32 ones left a hole the train step's one temporary
    # buffer could not fit in under a 16 GiB cap (H200, BENCHMARKS.md).
    @jax.jit
    def init(params):
        return _narrow(inner.init(params), dtype)

    def update(updates, state, params=None, **extra_args):
        wide = cast_floating(state, jnp.float32)
        seed = step_seed(state)
        updates, wide = inner.update(updates, wide, params, **extra_args)
        # Scalars back to the dtype they were stored in: one kept in bf16 (prodigy's
        # estimate with bf16 params) came back f32, and the state's dtypes changed.
        return updates, jax.tree.map(_scalar_like, _narrow(wide, dtype, seed, state), state)

    return optax.GradientTransformationExtraArgs(init, update)


def _scalar_like(new, old):
    """A floating scalar `new` in `old`'s dtype; anything else as it is."""
    if (is_floating_array(new) and not jnp.ndim(new) and is_floating_array(old)
            and new.dtype != old.dtype):
        return new.astype(old.dtype)
    return new


def _narrow(state, dtype, seed=None, old=None):
    """`state`'s floating arrays of rank >= 1 in `dtype`; scalars and integers as they are.

    With `seed` and `old` (the state before this step, same structure), f32 -> bf16 rounds
    stochastically (`jaxopt_train.stochastic_round`): rounded to nearest, Adam's second moment at
    b2 = 0.999 moves by less than half a bf16 step and stalls (at 0.25 of its value after
    3000 steps of constant gradients).
    """
    def one(x, before):
        if not (isinstance(x, (jax.Array, np.ndarray)) and x.ndim
                and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if (seed is not None and x.dtype == jnp.float32 and dtype == jnp.bfloat16
                and getattr(before, "shape", None) == x.shape):
            return stochastic_round_bf16(x, element_bits16(x, before, seed))
        return x.astype(dtype)
    return jax.tree.map(one, state, state if old is None else old)
