"""Loss scales for float16 training: none, static, and dynamic (grows, backs off, skips).

Each is a pytree (its arrays are traced leaves, its settings static), so it lives
inside a jitted train state. `scale(loss)` multiplies before differentiation,
`unscale(grads)` divides after, and `adjust(grads_finite)` returns the next scale
and counts skipped steps. `jaxopt_train.precision` re-exports them and picks one
per policy (`loss_scale_for`); `apply_updates_if_finite` there uses them.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np


def is_floating_array(x) -> bool:
    """True for an array (or anything with a dtype) of a floating dtype; ints, bools and
    PRNG keys are False, so casts and unscaling leave them alone."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


_F32 = np.finfo(np.float32)
# Scales live in float32 and unscale multiplies by 1/scale, so both the scale and
# its reciprocal must be normal float32s: 1e40 rounds to inf, 1e-50 to 0, below
# `tiny` 1/scale overflows, and above 2**126 1/scale is subnormal, which XLA
# flushes to 0 (every gradient would silently become 0). Dividing by the scale
# instead does not help: XLA rewrites `x / constant` into `x * (1 / constant)`
# whenever the scale is a compile-time constant (a scale closed over by jit), so
# the range is capped instead. The cap costs nothing: a loss scaled past 2**126
# overflows float32 for any loss above 4.
MAX_LOSS_SCALE = 2.0**126
_SCALE_RANGE = f"{_F32.tiny:.3g}..2**126 (where 1/scale is a normal float32 too)"
# Counters are int32 arrays compared with these settings under jit.
_INT32_MAX = int(np.iinfo(np.int32).max)


def _real_scalar(value, name: str) -> float:
    """`value` as a Python float; TypeError for None, strings, bools, complex numbers, arrays."""
    bad = (str, bytes, bool, np.bool_, complex, np.complexfloating)
    if value is None or isinstance(value, bad) or np.ndim(value) != 0:
        raise TypeError(f"{name}={value!r} must be a scalar real number (an int or a float)")
    return float(value)


def _as_float32(value: float) -> float:
    """`value` as the float32 it is stored in (overflow to inf is the point: no warning)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def _in_scale_range(value: float) -> bool:
    return _F32.tiny <= value <= MAX_LOSS_SCALE


def _count(value) -> int | None:
    """`value` as an int in 1..2**31-1 (a Python or numpy integer), or None if it is not one."""
    if isinstance(value, (bool, np.bool_)):  # True would pass as 1
        return None
    try:
        value = operator.index(value)
    except TypeError:
        return None
    return value if 1 <= value <= _INT32_MAX else None


def _finite_flag(grads_finite) -> jax.Array:
    """`grads_finite` checked to be one boolean (shape and dtype are static: works under jit)."""
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    dtype = getattr(grads_finite, "dtype", None)
    # Truthiness would let "yes", nan or 0.5 count as finite.
    if dtype is None or dtype != np.dtype(np.bool_):
        raise TypeError(f"grads_finite must be a bool or a boolean array such as all_finite(grads); "
                        f"got {type(grads_finite).__name__} with dtype {dtype}")
    if grads_finite.shape != ():
        # A vector would broadcast the loss scale and counters to its shape.
        raise ValueError(f"grads_finite must be a scalar boolean (shape ()); got shape "
                         f"{grads_finite.shape}; reduce it with all_finite(grads) or jnp.all(...)")
    return grads_finite


def _wide(dtype) -> np.dtype:
    """float32, or `dtype` itself when it is wider (float64): the dtype scaling runs in."""
    return np.dtype(dtype) if jnp.finfo(dtype).bits > 32 else np.dtype(jnp.float32)


class _LossScale:
    """Pytree plumbing: `_arrays` are traced leaves, `_statics` hashable config."""

    _arrays: tuple[str, ...] = ()
    _statics: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys_class(cls)

    def tree_flatten_with_keys(self):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in self._arrays)
        return children, tuple(getattr(self, n) for n in self._statics)

    def tree_flatten(self):
        return tuple(getattr(self, n) for n in self._arrays), tuple(
            getattr(self, n) for n in self._statics)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(cls._statics, aux):
            object.__setattr__(obj, name, value)
        for name, value in zip(cls._arrays, children):
            object.__setattr__(obj, name, value)
        return obj

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is immutable; use adjust()")

    def _init(self, **fields):
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _replace(self, **changes):
        leaves, aux = self.tree_flatten()
        new = type(self).tree_unflatten(aux, leaves)
        new._init(**changes)
        return new

    def __repr__(self):
        parts = [f"{n}={getattr(self, n)!r}" for n in self._arrays + self._statics]
        return f"{type(self).__name__}({', '.join(parts)})"

    def scale(self, tree):
        """Multiplies every floating leaf (usually the loss) by the loss scale, in f32.

        A float16 or bfloat16 leaf comes back as float32 (float64 stays float64):
        in float16 the product overflows once |loss| * scale > 65504, and the
        scale itself is inf from 2**16 on. The backward pass still hands a
        float16 loss the cotangent `scale` in float16, so gradients through a
        float16 loss overflow from a scale of 2**16; compute the loss in float32
        (`output_dtype` f32) and the dynamic scale has float32's whole range.
        """
        return jax.tree.map(lambda x: x.astype(_wide(x.dtype)) * self.loss_scale.astype(
            _wide(x.dtype)) if is_floating_array(x) else x, tree)

    def unscale(self, tree):
        """Divides every floating or complex leaf (usually gradients) by the loss scale,
        in f32 (float64 and complex128 leaves: in float64), and casts the result back to
        the leaf's dtype. (It multiplies by 1/scale, which the scale's range, at most
        `MAX_LOSS_SCALE`, keeps a normal float32; a reciprocal taken in f32 would put a
        4.7e-8 error on a float64 leaf unscaled by a scale that is not a power of 2.)"""
        def inverse(dtype):
            return 1.0 / self.loss_scale.astype(_wide(dtype))

        def one(x):
            if getattr(x, "dtype", None) is not None and jnp.issubdtype(x.dtype, jnp.complexfloating):
                # Complex params' gradients carry the scale too; complex64 has f32 parts.
                return x * inverse(jnp.finfo(x.dtype).dtype).astype(x.dtype)
            if not is_floating_array(x):
                return x
            wide = _wide(x.dtype)
            return (x.astype(wide) * inverse(x.dtype)).astype(x.dtype)
        return jax.tree.map(one, tree)

    def _count_skip(self, grads_finite):
        return self.skipped_steps + jnp.logical_not(grads_finite).astype(jnp.int32)

    def skip(self):
        """Counts a step skipped for a reason that says nothing about the scale (a batch
        with nothing to count): `skipped_steps += 1`, the scale and its counters unchanged."""
        return self._replace(skipped_steps=self.skipped_steps + 1)


class NoOpLossScale(_LossScale):
    """Scale 1: for fp32/bf16. Still counts skipped (non-finite) steps."""

    _arrays = ("skipped_steps",)

    def __init__(self):
        self._init(skipped_steps=jnp.zeros((), jnp.int32))

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree):
        return tree

    def unscale(self, tree):
        return tree

    def adjust(self, grads_finite) -> NoOpLossScale:
        return self._replace(skipped_steps=self._count_skip(_finite_flag(grads_finite)))


class StaticLossScale(_LossScale):
    """A fixed loss scale (the scale never changes; non-finite steps are counted)."""

    _arrays = ("loss_scale", "skipped_steps")

    def __init__(self, scale: float):
        stored = _as_float32(_real_scalar(scale, "scale"))
        if not _in_scale_range(stored):
            raise ValueError(f"scale={scale!r} must be a finite positive number in {_SCALE_RANGE} "
                             f"(it is stored in float32, where it is {np.float32(stored)!s})")
        self._init(loss_scale=jnp.asarray(stored, jnp.float32),
                   skipped_steps=jnp.zeros((), jnp.int32))

    def adjust(self, grads_finite) -> StaticLossScale:
        return self._replace(skipped_steps=self._count_skip(_finite_flag(grads_finite)))


class DynamicLossScale(_LossScale):
    """Loss scale that grows while gradients stay finite and backs off on overflow.

    Rules, applied by `adjust(grads_finite)` once per optimizer step
    (Megatron-LM's semantics for hysteresis):

    - finite step: `growth_counter += 1`; when it reaches `growth_interval`
      the scale is multiplied by `growth_factor`, never above `MAX_LOSS_SCALE`
      (2**126, past which `unscale` would zero the gradients),
      the counter restarts at 0 and the hysteresis budget refills.
    - non-finite step: `skipped_steps += 1`, `growth_counter = 0`,
      `hysteresis_left -= 1`; once `hysteresis_left <= 0` the scale is
      multiplied by `backoff_factor`, never below `min_scale`. The budget
      refills only on growth, so after the first back-off every further
      overflow backs off again until the scale grows.

    Defaults against the usual references: `initial_scale` 2**15 is TensorFlow's
    (PyTorch's GradScaler starts at 2**16, Megatron-LM at 2**32, jmp has none); 2**15
    is the largest power of 2 finite in float16, so a float16 loss's backward pass
    starts finite. `hysteresis` 2 is Megatron-LM's: PyTorch and jmp back off on the
    first overflow, which is `hysteresis=1` here. `growth_interval` 2000,
    `growth_factor` 2 and `backoff_factor` 0.5 are PyTorch's and jmp's (Megatron-LM
    grows every 1000); `min_scale` 1 is jmp's and Megatron-LM's (PyTorch has no floor).

    Attributes (arrays): loss_scale (f32), growth_counter, hysteresis_left,
    skipped_steps (int32). Config (static): growth_interval, growth_factor,
    backoff_factor, hysteresis, min_scale.
    """

    _arrays = ("loss_scale", "growth_counter", "hysteresis_left", "skipped_steps")
    _statics = ("growth_interval", "growth_factor", "backoff_factor", "hysteresis", "min_scale")

    def __init__(self, initial_scale: float = 2.0**15, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 hysteresis: int = 2, min_scale: float = 1.0):
        # Checked as the float32 values the arithmetic uses, not as the float64 given.
        given = {"initial_scale": initial_scale, "growth_factor": growth_factor,
                 "backoff_factor": backoff_factor, "min_scale": min_scale}
        initial, growth, backoff, minimum = (_as_float32(_real_scalar(v, k)) for k, v in given.items())
        interval, budget = _count(growth_interval), _count(hysteresis)
        checks = {
            f"initial_scale > 0 in {_SCALE_RANGE}": _in_scale_range(initial),
            "growth_interval >= 1 (an int <= 2**31-1)": interval is not None,
            "growth_factor > 1 and finite in float32": 1 < growth <= _F32.max,
            "0 < backoff_factor < 1 in float32": 0 < backoff < 1,
            "hysteresis >= 1 (an int <= 2**31-1)": budget is not None,
            f"min_scale > 0 in {_SCALE_RANGE}": _in_scale_range(minimum),
            # Raising it to min_scale instead would silently ignore initial_scale.
            "initial_scale >= min_scale": initial >= minimum,
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ValueError(
                f"DynamicLossScale needs {', '.join(failed)}; got {initial_scale=}, "
                f"{growth_interval=}, {growth_factor=}, {backoff_factor=}, {hysteresis=}, {min_scale=}")
        self._init(loss_scale=jnp.asarray(initial, jnp.float32),
                   growth_counter=jnp.zeros((), jnp.int32),
                   hysteresis_left=jnp.asarray(budget, jnp.int32),
                   skipped_steps=jnp.zeros((), jnp.int32),
                   growth_interval=interval, growth_factor=float(growth_factor),
                   backoff_factor=float(backoff_factor), hysteresis=budget,
                   min_scale=float(min_scale))

    def adjust(self, grads_finite) -> DynamicLossScale:
        finite = _finite_flag(grads_finite)
        counter = jnp.where(finite, self.growth_counter + 1, 0)
        grow = counter >= self.growth_interval
        # Capped, not kept: inf (an f32 overflow) also lands on the cap.
        grown = jnp.minimum(self.loss_scale * self.growth_factor, MAX_LOSS_SCALE)
        hysteresis_left = jnp.where(finite, self.hysteresis_left, self.hysteresis_left - 1)
        back_off = jnp.logical_not(finite) & (hysteresis_left <= 0)
        backed = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_scale)
        new_scale = jnp.where(grow, grown, jnp.where(back_off, backed, self.loss_scale))
        return self._replace(
            loss_scale=new_scale.astype(jnp.float32),
            growth_counter=jnp.where(grow, 0, counter).astype(jnp.int32),
            hysteresis_left=jnp.where(grow, self.hysteresis, hysteresis_left).astype(jnp.int32),
            skipped_steps=self._count_skip(finite))


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
