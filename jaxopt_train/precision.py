"""Mixed-precision policies and loss scaling.

A `Policy` names three dtypes: `param_dtype` (how the optimizer stores master
weights), `compute_dtype` (what the forward and backward passes run in) and
`output_dtype` (what the model hands to the loss), plus an optional
`matmul_precision` for float32 matmuls (e.g. TensorFloat-32).

Loss scales are pytrees, so they live inside a jitted train state:

    scale = loss_scale_for(policy)
    def step(params, opt_state, scale, batch):
        def loss_fn(p):
            return scale.scale(compute_loss(p, batch))
        grads = jax.grad(loss_fn)(params)
        params, opt_state, scale, finite = apply_updates_if_finite(
            optimizer, grads, opt_state, params, scale)
        return params, opt_state, scale

`apply_updates_if_finite` unscales the gradients and leaves params and optimizer
state bit-for-bit unchanged when any gradient is inf/nan, so a fp16 overflow
costs one step instead of corrupting the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPE_ALIASES = {
    "f32": jnp.float32, "float32": jnp.float32, "fp32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "float16": jnp.float16, "fp16": jnp.float16,
    "f64": jnp.float64, "float64": jnp.float64,
}
_STRING_KEYS = {
    "p": "param_dtype", "params": "param_dtype", "param": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
    "m": "matmul_precision", "matmul": "matmul_precision",
}
# Names accepted by `jax.default_matmul_precision`; "tensorfloat32" is TF32 on
# NVIDIA Ampere+ (Precision.HIGH), "float32"/"highest" force full f32 passes.
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def as_float_dtype(value: Any, field: str) -> np.dtype:
    """`value` (a dtype or a name such as "bf16") as a floating numpy dtype; `field` names it in errors."""
    if isinstance(value, str):
        if value.lower() not in _DTYPE_ALIASES:
            raise ValueError(f"{field}={value!r} is not a known dtype name; "
                             f"expected one of {sorted(_DTYPE_ALIASES)}")
        value = _DTYPE_ALIASES[value.lower()]
    try:
        dtype = np.dtype(value)
    except TypeError as err:
        raise TypeError(f"{field}={value!r} is not a dtype") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{field}={dtype} must be a floating dtype "
                         "(float32, bfloat16, float16, float64)")
    return dtype


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters, computation and outputs use.

    Attributes:
      param_dtype: dtype of the master weights held by the optimizer.
      compute_dtype: dtype params and floating inputs are cast to for the
        forward/backward pass.
      output_dtype: dtype of the model outputs handed to the loss.
      matmul_precision: None (JAX's default for the platform) or one of
        `MATMUL_PRECISIONS`; applied by `matmul_scope()` (and so by
        `nnx_apply` / `linen_apply`) through `jax.default_matmul_precision`,
        which JAX reads when it traces each dot.
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    matmul_precision: str | None = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, as_float_dtype(getattr(self, field), field))
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision={self.matmul_precision!r}; expected None or one "
                             f"of {MATMUL_PRECISIONS}")

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parses `"p=f32,c=bf16,o=f32"` (optionally `,m=tensorfloat32`).

        Keys: p/param/params, c/compute, o/output, m/matmul. A missing output
        dtype defaults to the compute dtype; a missing compute dtype to the
        param dtype.
        """
        if not isinstance(spec, str):
            raise TypeError(f"spec={spec!r} must be a string like 'p=f32,c=bf16,o=f32'")
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _STRING_KEYS:
                raise ValueError(f"bad policy item {part!r} in {spec=}; expected key=value with "
                                 f"key in {sorted(_STRING_KEYS)}")
            fields[_STRING_KEYS[key]] = value.strip()
        if "param_dtype" not in fields:
            raise ValueError(f"{spec=} must name the param dtype, e.g. 'p=f32,c=bf16,o=f32'")
        fields.setdefault("compute_dtype", fields["param_dtype"])
        fields.setdefault("output_dtype", fields["compute_dtype"])
        return cls(**fields)

    @property
    def needs_loss_scale(self) -> bool:
        """True when gradients flow through float16, whose range underflows."""
        half = np.dtype(jnp.float16)
        return half in (self.param_dtype, self.compute_dtype, self.output_dtype)

    def cast_to_param(self, tree):
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree):
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree):
        return cast_floating(tree, self.output_dtype)

    def matmul_scope(self):
        """Context manager that applies `matmul_precision` while tracing."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)


_PRESETS = {
    # JAX's default precision: on NVIDIA Ampere+ XLA may already run f32 dots
    # in TF32; use Policy(..., matmul_precision="highest") for true f32.
    "fp32": dict(param_dtype="f32", compute_dtype="f32", output_dtype="f32"),
    "tf32": dict(param_dtype="f32", compute_dtype="f32", output_dtype="f32",
                 matmul_precision="tensorfloat32"),
    "bf16": dict(param_dtype="f32", compute_dtype="bf16", output_dtype="f32"),
    "bf16-pure": dict(param_dtype="bf16", compute_dtype="bf16", output_dtype="bf16"),
    "fp16": dict(param_dtype="f32", compute_dtype="f16", output_dtype="f32"),
}
PRESETS = tuple(_PRESETS)


def get_policy(name_or_policy: str | Policy) -> Policy:
    """Returns a preset (`PRESETS`), parses a `from_string` spec, or passes a Policy through."""
    if isinstance(name_or_policy, Policy):
        return name_or_policy
    if not isinstance(name_or_policy, str):
        raise TypeError(f"name_or_policy={name_or_policy!r} must be a Policy or one of {PRESETS}")
    if name_or_policy in _PRESETS:
        return Policy(**_PRESETS[name_or_policy])
    if "=" in name_or_policy:
        return Policy.from_string(name_or_policy)
    raise ValueError(f"unknown precision policy {name_or_policy!r}; expected one of {PRESETS} "
                     "or a spec like 'p=f32,c=bf16,o=f32'")


def _is_floating_array(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree, dtype):
    """`tree` with every floating array leaf cast to `dtype`."""
    # Only array leaves with a floating dtype: ints, bools, PRNG keys (typed
    # or raw uint32) and Python scalars keep their type.
    return jax.tree.map(lambda x: x.astype(dtype) if _is_floating_array(x) else x, tree)


def nnx_apply_with_state(policy: Policy, graphdef, state, *args, **kwargs):
    """Runs an NNX module under `policy`; returns `(outputs, new_state)`.

    `nnx.Param`s and floating inputs are cast to the compute dtype (other
    state, e.g. BatchStat, keeps its dtype), outputs to the
    output dtype, and the state after the call (BatchNorm statistics, RNG
    counters) back to the param dtype. Gradients w.r.t. `state` come back in
    the dtype of `state`, i.e. the f32 master weights.
    """
    from flax import nnx  # noqa: PLC0415  (keeps precision importable without flax)

    model = nnx.merge(graphdef, state)
    # Only Params go to the compute dtype: statistics (BatchStat) and other
    # state keep their own dtype, as mixed-precision training wants.
    nnx.update(model, policy.cast_to_compute(nnx.state(model, nnx.Param)))
    with policy.matmul_scope():
        out = model(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
    _, new_state = nnx.split(model)
    return policy.cast_to_output(out), _cast_like(new_state, state)


def nnx_apply(policy: Policy, graphdef, state, *args, **kwargs):
    """Runs `nnx.merge(graphdef, state)(*args, **kwargs)` under `policy`; returns outputs only.

    Use `nnx_apply_with_state` when the module updates its own state.
    """
    return nnx_apply_with_state(policy, graphdef, state, *args, **kwargs)[0]


def linen_apply(policy: Policy, module, variables, *args, **kwargs):
    """`module.apply(variables, *args, **kwargs)` under `policy`.

    The "params" collection (all variables if there is none) and floating
    inputs are cast to the compute dtype; other collections such as
    "batch_stats" keep theirs. With `mutable=...` Linen returns `(outputs, updates)`; the outputs are cast to
    the output dtype and the updated collections back to the param dtype.
    """
    with policy.matmul_scope():
        result = module.apply(_cast_linen_params(policy, variables),
                              *policy.cast_to_compute(args), **_cast_kwargs(policy, kwargs))
    if kwargs.get("mutable", False) is not False:
        out, updates = result
        return policy.cast_to_output(out), policy.cast_to_param(updates)
    return policy.cast_to_output(result)


def _cast_linen_params(policy: Policy, variables):
    if isinstance(variables, dict) and "params" in variables:
        return {**variables, "params": policy.cast_to_compute(variables["params"])}
    return policy.cast_to_compute(variables)


def _cast_kwargs(policy: Policy, kwargs):
    # Linen's own keywords (rngs, mutable, method) must pass through untouched.
    reserved = {"rngs", "mutable", "method", "capture_intermediates"}
    return {k: v if k in reserved else policy.cast_to_compute(v) for k, v in kwargs.items()}


def _cast_like(tree, reference):
    return jax.tree.map(
        lambda x, r: x.astype(r.dtype) if _is_floating_array(x) and _is_floating_array(r) else x,
        tree, reference)


# ----------------------------------------------------------------------------- loss scales


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
        """Multiplies every floating leaf (usually the loss) by the loss scale."""
        return jax.tree.map(lambda x: x * self.loss_scale.astype(x.dtype)
                            if _is_floating_array(x) else x, tree)

    def unscale(self, tree):
        """Divides every floating leaf (usually gradients) by the loss scale, in f32."""
        inverse = 1.0 / self.loss_scale

        def one(x):
            if not _is_floating_array(x):
                return x
            wide = x.dtype if jnp.finfo(x.dtype).bits > 32 else np.dtype(jnp.float32)
            return (x.astype(wide) * inverse.astype(wide)).astype(x.dtype)
        return jax.tree.map(one, tree)

    def _count_skip(self, grads_finite):
        return self.skipped_steps + jnp.logical_not(grads_finite).astype(jnp.int32)


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
        return self._replace(skipped_steps=self._count_skip(grads_finite))


class StaticLossScale(_LossScale):
    """A fixed loss scale (the scale never changes; non-finite steps are counted)."""

    _arrays = ("loss_scale", "skipped_steps")

    def __init__(self, scale: float):
        if not np.isscalar(scale) and np.ndim(scale) != 0:
            raise TypeError(f"scale={scale!r} must be a scalar")
        if not float(scale) > 0 or not np.isfinite(float(scale)):
            raise ValueError(f"scale={scale!r} must be a finite positive number")
        self._init(loss_scale=jnp.asarray(scale, jnp.float32),
                   skipped_steps=jnp.zeros((), jnp.int32))

    def adjust(self, grads_finite) -> StaticLossScale:
        return self._replace(skipped_steps=self._count_skip(grads_finite))


class DynamicLossScale(_LossScale):
    """Loss scale that grows while gradients stay finite and backs off on overflow.

    Rules, applied by `adjust(grads_finite)` once per optimizer step
    (Megatron-LM's semantics for hysteresis):

    - finite step: `growth_counter += 1`; when it reaches `growth_interval`
      the scale is multiplied by `growth_factor` (kept if that overflows f32),
      the counter restarts at 0 and the hysteresis budget refills.
    - non-finite step: `skipped_steps += 1`, `growth_counter = 0`,
      `hysteresis_left -= 1`; once `hysteresis_left <= 0` the scale is
      multiplied by `backoff_factor`, never below `min_scale`. The budget
      refills only on growth, so after the first back-off every further
      overflow backs off again until the scale grows.

    Attributes (arrays): loss_scale (f32), growth_counter, hysteresis_left,
    skipped_steps (int32). Config (static): growth_interval, growth_factor,
    backoff_factor, hysteresis, min_scale.
    """

    _arrays = ("loss_scale", "growth_counter", "hysteresis_left", "skipped_steps")
    _statics = ("growth_interval", "growth_factor", "backoff_factor", "hysteresis", "min_scale")

    def __init__(self, initial_scale: float = 2.0**15, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 hysteresis: int = 2, min_scale: float = 1.0):
        checks = {
            "initial_scale > 0": float(initial_scale) > 0,
            "growth_interval >= 1 (an int)": isinstance(growth_interval, int) and growth_interval >= 1,
            "growth_factor >= 1": float(growth_factor) >= 1,
            "0 < backoff_factor <= 1": 0 < float(backoff_factor) <= 1,
            "hysteresis >= 1 (an int)": isinstance(hysteresis, int) and hysteresis >= 1,
            "min_scale > 0": float(min_scale) > 0,
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ValueError(
                f"DynamicLossScale needs {', '.join(failed)}; got {initial_scale=}, "
                f"{growth_interval=}, {growth_factor=}, {backoff_factor=}, {hysteresis=}, {min_scale=}")
        self._init(loss_scale=jnp.asarray(max(float(initial_scale), float(min_scale)), jnp.float32),
                   growth_counter=jnp.zeros((), jnp.int32),
                   hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
                   skipped_steps=jnp.zeros((), jnp.int32),
                   growth_interval=growth_interval, growth_factor=float(growth_factor),
                   backoff_factor=float(backoff_factor), hysteresis=hysteresis,
                   min_scale=float(min_scale))

    def adjust(self, grads_finite) -> DynamicLossScale:
        finite = jnp.asarray(grads_finite, jnp.bool_)
        counter = jnp.where(finite, self.growth_counter + 1, 0)
        grow = counter >= self.growth_interval
        grown = self.loss_scale * self.growth_factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
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


def loss_scale_for(policy: str | Policy) -> LossScale:
    """DynamicLossScale() when the policy computes in float16, else NoOpLossScale()."""
    return DynamicLossScale() if get_policy(policy).needs_loss_scale else NoOpLossScale()


def all_finite(tree) -> jax.Array:
    """Scalar bool: every floating leaf of `tree` is free of inf and nan."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_floating_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(leaves))


def select_tree(pred, on_true, on_false):
    """`on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf (same structure)."""
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"pred must be a scalar, got shape {pred.shape}")
    return jax.tree.map(lambda a, b: jax.lax.select(pred.astype(jnp.bool_), a, b)
                        if hasattr(a, "dtype") else (a if a == b else _bad_static(a, b)),
                        on_true, on_false)


def _bad_static(a, b):
    raise ValueError(f"select_tree: non-array leaves differ ({a!r} vs {b!r}); only arrays can be selected")


def apply_updates_if_finite(optimizer, grads, opt_state, params, loss_scale: LossScale):
    """Unscales `grads`, applies one optax step only if they are all finite.

    Args:
      optimizer: an `optax.GradientTransformation`.
      grads: gradients of the *scaled* loss (pytree like `params`).
      opt_state: the optimizer state.
      params: the (f32 master) parameters.
      loss_scale: the loss scale used for `grads`.

    Returns:
      `(params, opt_state, loss_scale, grads_finite)`: when `grads_finite` is
      False, params and opt_state are the inputs unchanged and the loss scale
      has backed off / counted the skip.
    """
    import optax  # noqa: PLC0415

    grads = loss_scale.unscale(grads)
    finite = all_finite(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = select_tree(finite, new_params, params)
    opt_state = select_tree(finite, new_opt_state, opt_state)
    return params, opt_state, loss_scale.adjust(finite), finite
