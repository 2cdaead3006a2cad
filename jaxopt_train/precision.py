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
    if value is None:  # np.dtype(None) would silently be float64
        raise TypeError(f"{field}=None is not a dtype; expected a floating dtype or one of "
                        f"{sorted(_DTYPE_ALIASES)}")
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
            field = _STRING_KEYS[key]
            if field in fields:  # "p=f32,param=bf16": neither value may silently win
                raise ValueError(f"policy item {part!r} in {spec=} sets {field} again (already "
                                 f"{fields[field]!r}); give each key once")
            fields[field] = value.strip()
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
    """`tree` with every floating array leaf cast to `dtype` (a floating dtype or a name: "bf16")."""
    dtype = as_float_dtype(dtype, "dtype")  # an int dtype would truncate the floats silently
    # Only array leaves with a floating dtype: ints, bools, PRNG keys (typed
    # or raw uint32) and Python scalars keep their type.
    return jax.tree.map(lambda x: x.astype(dtype) if _is_floating_array(x) else x, tree)


def nnx_apply_with_state(policy: str | Policy, graphdef, state, *args, **kwargs):
    """Runs an NNX module under `policy`; returns `(outputs, new_state)`.

    `nnx.Param`s and floating inputs are cast to the compute dtype (other
    state, e.g. BatchStat, keeps its dtype), outputs to the
    output dtype, and the state after the call (BatchNorm statistics, RNG
    counters) back to the param dtype. Gradients w.r.t. `state` come back in
    the dtype of `state`, i.e. the f32 master weights. `policy` is a Policy or
    a name `get_policy` accepts.
    """
    from flax import nnx  # noqa: PLC0415  (keeps precision importable without flax)

    policy = get_policy(policy)
    model = nnx.merge(graphdef, state)
    # Only Params go to the compute dtype: statistics (BatchStat) and other
    # state keep their own dtype, as mixed-precision training wants.
    nnx.update(model, policy.cast_to_compute(nnx.state(model, nnx.Param)))
    with policy.matmul_scope():
        out = model(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
    _, new_state = nnx.split(model)
    return policy.cast_to_output(out), _cast_like(new_state, state)


def nnx_apply(policy: str | Policy, graphdef, state, *args, **kwargs):
    """Runs `nnx.merge(graphdef, state)(*args, **kwargs)` under `policy`; returns outputs only.

    Use `nnx_apply_with_state` when the module updates its own state.
    """
    return nnx_apply_with_state(policy, graphdef, state, *args, **kwargs)[0]


def linen_apply(policy: str | Policy, module, variables, *args, **kwargs):
    """`module.apply(variables, *args, **kwargs)` under `policy`.

    The "params" collection (all variables if there is none) and floating
    inputs are cast to the compute dtype; other collections such as
    "batch_stats" keep theirs. With `mutable=...` Linen returns `(outputs, updates)`; the outputs are cast to
    the output dtype and the updated collections back to the param dtype.
    `policy` is a Policy or a name `get_policy` accepts.
    """
    policy = get_policy(policy)
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


_F32 = np.finfo(np.float32)
# Scales live in float32 and unscale multiplies by 1/scale, so a scale must be a
# normal float32: 1e40 rounds to inf, 1e-50 to 0, and below `tiny` 1/scale overflows.
_F32_NORMAL = f"{_F32.tiny:.3g}..{_F32.max:.3g}"


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


def _is_normal_float32(value: float) -> bool:
    return _F32.tiny <= value <= _F32.max


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
        return self._replace(skipped_steps=self._count_skip(_finite_flag(grads_finite)))


class StaticLossScale(_LossScale):
    """A fixed loss scale (the scale never changes; non-finite steps are counted)."""

    _arrays = ("loss_scale", "skipped_steps")

    def __init__(self, scale: float):
        stored = _as_float32(_real_scalar(scale, "scale"))
        if not _is_normal_float32(stored):
            raise ValueError(f"scale={scale!r} must be a finite positive number in float32's normal "
                             f"range {_F32_NORMAL} (it is stored in float32, where it is "
                             f"{np.float32(stored)!s})")
        self._init(loss_scale=jnp.asarray(stored, jnp.float32),
                   skipped_steps=jnp.zeros((), jnp.int32))

    def adjust(self, grads_finite) -> StaticLossScale:
        return self._replace(skipped_steps=self._count_skip(_finite_flag(grads_finite)))


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
        # Checked as the float32 values the arithmetic uses, not as the float64 given.
        given = {"initial_scale": initial_scale, "growth_factor": growth_factor,
                 "backoff_factor": backoff_factor, "min_scale": min_scale}
        initial, growth, backoff, minimum = (_as_float32(_real_scalar(v, k)) for k, v in given.items())
        checks = {
            f"initial_scale > 0 in float32's normal range {_F32_NORMAL}": _is_normal_float32(initial),
            "growth_interval >= 1 (an int)": isinstance(growth_interval, int) and growth_interval >= 1,
            "growth_factor > 1 and finite in float32": 1 < growth <= _F32.max,
            "0 < backoff_factor < 1 in float32": 0 < backoff < 1,
            "hysteresis >= 1 (an int)": isinstance(hysteresis, int) and hysteresis >= 1,
            f"min_scale > 0 in float32's normal range {_F32_NORMAL}": _is_normal_float32(minimum),
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
                   hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
                   skipped_steps=jnp.zeros((), jnp.int32),
                   growth_interval=growth_interval, growth_factor=float(growth_factor),
                   backoff_factor=float(backoff_factor), hysteresis=hysteresis,
                   min_scale=float(min_scale))

    def adjust(self, grads_finite) -> DynamicLossScale:
        finite = _finite_flag(grads_finite)
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


def _is_inexact(x) -> bool:
    # Python floats are leaves too: {"loss": float("nan")} must not pass as finite.
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def all_finite(tree) -> jax.Array:
    """Scalar bool: every floating or complex leaf of `tree` (array or Python number) is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_inexact(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(leaves))


def select_tree(pred, on_true, on_false):
    """`on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf (same structure)."""
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"pred must be a scalar, got shape {pred.shape}")
    _check_leaves_match(on_true, on_false, "on_true", "on_false", dtypes=True)
    return jax.tree.map(lambda a, b: jax.lax.select(pred.astype(jnp.bool_), a, b)
                        if hasattr(a, "dtype") else (a if a == b else _bad_static(a, b)),
                        on_true, on_false)


def _bad_static(a, b):
    raise ValueError(f"select_tree: non-array leaves differ ({a!r} vs {b!r}); only arrays can be selected")


def _leaf_dtype(x):
    # A Python number opposite an array is fine for lax.select when its dtype would match.
    if hasattr(x, "dtype"):
        return x.dtype
    return jnp.result_type(x) if isinstance(x, (int, float, complex)) else None


def _check_leaves_match(given, expected, given_name: str, expected_name: str, *, dtypes: bool):
    """Raises ValueError at the first leaf where `given` differs from `expected` in tree path,
    shape or (with `dtypes`) dtype. All static, so it runs once, at trace time."""
    given_leaves, given_def = jax.tree_util.tree_flatten_with_path(given)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    if given_def != expected_def:
        given_paths = [jax.tree_util.keystr(path) for path, _ in given_leaves]
        expected_paths = [jax.tree_util.keystr(path) for path, _ in expected_leaves]
        given_set, expected_set = set(given_paths), set(expected_paths)
        missing = [p for p in expected_paths if p not in given_set]
        extra = [p for p in given_paths if p not in expected_set]
        found = []
        if missing:
            found.append(f"{given_name} has no leaf at {missing[0]} ({expected_name} has)")
        if extra:
            found.append(f"{given_name} has a leaf at {extra[0]} ({expected_name} has none)")
        # Same leaf paths in other containers (a tuple for a list): only the treedefs tell.
        detail = "; ".join(found) or f"expected {expected_def}, given {given_def}"
        raise ValueError(f"{given_name} must have the tree structure of {expected_name}; {detail}")
    for (path, g), (_, e) in zip(given_leaves, expected_leaves):
        where = jax.tree_util.keystr(path)
        if np.shape(g) != np.shape(e):
            raise ValueError(f"{given_name}{where} has shape {np.shape(g)}; expected "
                             f"{np.shape(e)}, the shape of {expected_name}{where}")
        arrays = hasattr(g, "dtype") or hasattr(e, "dtype")  # static leaves are compared by value
        if dtypes and arrays and _leaf_dtype(g) != _leaf_dtype(e):
            raise ValueError(f"{given_name}{where} has dtype {_leaf_dtype(g)}; expected "
                             f"{_leaf_dtype(e)}, the dtype of {expected_name}{where}")


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

    # optax would broadcast a (1,) or () gradient onto a (3,) param without a word.
    _check_leaves_match(grads, params, "grads", "params", dtypes=False)
    grads = loss_scale.unscale(grads)
    finite = all_finite(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = select_tree(finite, new_params, params)
    opt_state = select_tree(finite, new_opt_state, opt_state)
    return params, opt_state, loss_scale.adjust(finite), finite
