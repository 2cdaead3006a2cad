"""Mixed-precision policies and loss scaling.

A `Policy` names three dtypes: `param_dtype` (how the optimizer stores master
weights), `compute_dtype` (what the forward and backward passes run in) and
`output_dtype` (what the model hands to the loss), plus an optional
`matmul_precision` for float32 matmuls (e.g. TensorFloat-32).

Loss scales (defined in `jaxopt_train.loss_scale`, re-exported here) are pytrees,
so they live inside a jitted train state:

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
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_train._trees import leaf_path_diff
from jaxopt_train.loss_scale import MAX_LOSS_SCALE as MAX_LOSS_SCALE
from jaxopt_train.loss_scale import DynamicLossScale as DynamicLossScale
from jaxopt_train.loss_scale import LossScale as LossScale
from jaxopt_train.loss_scale import NoOpLossScale as NoOpLossScale
from jaxopt_train.loss_scale import StaticLossScale as StaticLossScale
from jaxopt_train.loss_scale import is_floating_array

_DTYPE_ALIASES = {
    "f32": jnp.float32, "float32": jnp.float32, "fp32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "float16": jnp.float16, "fp16": jnp.float16,
    "f64": jnp.float64, "float64": jnp.float64,
}
_FLOAT_DTYPES = frozenset(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
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
    # float8 and float128 are floating too, but nothing here computes in them: a policy
    # of float8 params, or float128 (which JAX cannot hold), must fail here.
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{field}={dtype} must be a floating dtype this library computes in: "
                         "one of float32, bfloat16, float16, float64")
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
            dtype = as_float_dtype(getattr(self, field), field)
            # Without x64 JAX makes float32 arrays from a float64 cast (with a warning
            # only), so the policy would name a dtype it never applies.
            if dtype == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
                raise ValueError(f"{field}=float64 needs 64-bit JAX, which is off: call "
                                 "jax.config.update('jax_enable_x64', True) first, or use "
                                 "float32")
            object.__setattr__(self, field, dtype)
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


def check_trainable(policy: Policy) -> None:
    """Raises ValueError for a policy training cannot use: float16 master weights.

    Their 10-bit mantissa rounds away any update below 2**-11 of the weight (lr 1e-3
    times a unit gradient, for instance), so the loss stops falling without an error;
    loss scaling does not help, it only protects the gradients. (Inference through
    `nnx_apply` / `linen_apply` may use float16 params.)"""
    if policy.param_dtype == np.dtype(jnp.float16):
        raise ValueError(
            "param_dtype=float16 cannot hold the weights being trained: updates smaller than "
            "2**-11 of a weight round away and training stalls silently; use 'fp16' (float32 "
            "master weights, float16 compute, 'p=f32,c=f16,o=f32') or 'bf16-pure'")


def cast_floating(tree, dtype):
    """`tree` with every floating array leaf cast to `dtype` (a floating dtype or a name: "bf16")."""
    dtype = as_float_dtype(dtype, "dtype")  # an int dtype would truncate the floats silently
    # Only array leaves with a floating dtype: ints, bools, PRNG keys (typed
    # or raw uint32) and Python scalars keep their type.
    return jax.tree.map(lambda x: x.astype(dtype) if is_floating_array(x) else x, tree)


def nnx_apply_with_state(policy: str | Policy, graphdef, state, *args, **kwargs):
    """Runs an NNX module under `policy`; returns `(outputs, new_state)`.

    `nnx.Param`s and floating inputs are cast to the compute dtype (other
    state, e.g. BatchStat, keeps its dtype), outputs to the
    output dtype, and the state after the call (BatchNorm statistics, RNG
    counters) back to the dtypes `state` has; variables the call adds
    (`self.sow(nnx.Intermediate, ...)`) keep their own, and variables the call does not
    write (the Params) come back as `state`'s own arrays, not rounded through the compute
    dtype. `state` itself is left untouched
    (the module runs on a copy), so it may be closed over inside `jax.jit`.
    Gradients w.r.t. `state` come back in the dtype of `state`, i.e. the f32
    master weights. `policy` is a Policy or a name `get_policy` accepts.
    """
    from flax import nnx  # noqa: PLC0415  (keeps precision importable without flax)

    policy = get_policy(policy)
    # nnx.merge reuses the Variables it is given and the call writes into them
    # (the cast, BatchNorm statistics, RNG counters): merged from `state` itself,
    # the caller's master weights would turn bf16 and a `state` closed over by
    # jax.jit would raise TraceContextError. jax.tree.map builds new Variables,
    # so the module runs on a copy and `state` keeps its values and dtypes for
    # the cast back below.
    compute_state = _compute_copy(policy, state)
    # Read before the call: the call writes into compute_state's Variables.
    passed = _leaves_by_path(compute_state)
    model = nnx.merge(graphdef, compute_state)
    with policy.matmul_scope():
        out = model(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
    _, new_state = nnx.split(model)
    return policy.cast_to_output(out), _cast_like(new_state, state, passed)


def nnx_apply(policy: str | Policy, graphdef, state, *args, **kwargs):
    """Runs `nnx.merge(graphdef, state)(*args, **kwargs)` under `policy`; returns outputs only.

    Use `nnx_apply_with_state` when the module updates its own state.
    """
    return nnx_apply_with_state(policy, graphdef, state, *args, **kwargs)[0]


def linen_apply(policy: str | Policy, module, variables, *args, **kwargs):
    """`module.apply(variables, *args, **kwargs)` under `policy`.

    The "params" collection (all variables if there is none) and floating
    inputs are cast to the compute dtype; other collections such as
    "batch_stats" keep theirs. `variables` may be any mapping (a dict or a
    `FrozenDict`). With `mutable=...` (or `capture_intermediates`) Linen returns
    `(outputs, updates)`; the outputs are cast to the output dtype and each
    updated variable back to the dtype it has in `variables` (variables the
    call creates, such as sown "intermediates", keep their own). `policy` is a
    Policy or a name `get_policy` accepts.
    """
    policy = get_policy(policy)
    compute_variables = _cast_linen_params(policy, variables)
    passed = _leaves_by_path(compute_variables)
    with policy.matmul_scope():
        result = module.apply(compute_variables,
                              *policy.cast_to_compute(args), **_cast_kwargs(policy, kwargs))
    # capture_intermediates makes Linen return (outputs, updates) too (it adds the
    # "intermediates" collection to `mutable`): cast as a whole, the intermediates took
    # the output dtype instead of keeping their own.
    if kwargs.get("mutable", False) is not False or kwargs.get("capture_intermediates", False):
        out, updates = result
        return policy.cast_to_output(out), _cast_like(updates, variables, passed)
    return policy.cast_to_output(result)


def _compute_copy(policy: Policy, state):
    """A copy of the NNX `state` (new Variable objects, so nothing written during the call
    reaches `state`) with its `nnx.Param`s in the compute dtype. Statistics (BatchStat) and
    other state keep their dtype, as mixed-precision training wants."""
    from flax import nnx  # noqa: PLC0415

    def copy(variable):
        if isinstance(variable, nnx.Param):
            return policy.cast_to_compute(variable)
        return jax.tree.map(lambda x: x, variable)
    return jax.tree.map(copy, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _cast_linen_params(policy: Policy, variables):
    # Any Mapping: a FrozenDict taken for "no collections" would have its
    # batch_stats and caches cast to the compute dtype too.
    if isinstance(variables, Mapping) and "params" in variables:
        return {**variables, "params": policy.cast_to_compute(variables["params"])}
    return policy.cast_to_compute(variables)


def _cast_kwargs(policy: Policy, kwargs):
    # Linen's own keywords (rngs, mutable, method) must pass through untouched.
    reserved = {"rngs", "mutable", "method", "capture_intermediates"}
    return {k: v if k in reserved else policy.cast_to_compute(v) for k, v in kwargs.items()}


def _leaves_by_path(tree) -> dict:
    return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


def _cast_like(tree, reference, passed: dict | None = None):
    """`tree` with each floating leaf cast to the dtype of the floating leaf at the same
    key path in `reference`. Matched by path, not by structure: a call may add leaves
    (sown intermediates, new collections), and those keep their own dtype.

    A leaf of `tree` that is the very array `passed` (`_leaves_by_path` of what the call
    ran on, taken before it) holds at its path, i.e. one the call left alone, comes back
    as `reference`'s own leaf: cast back from the bf16 compute copy, the f32 master
    weights would come back rounded to bf16, and a caller carrying the returned state
    (for its BatchNorm statistics) into the next step would train bf16 weights."""
    reference_leaves = _leaves_by_path(reference)
    passed = passed or {}
    reference_dtypes = {path: leaf.dtype for path, leaf in reference_leaves.items()
                        if is_floating_array(leaf)}

    def cast(path, x):
        if path in reference_leaves and path in passed and x is passed[path]:
            return reference_leaves[path]
        dtype = reference_dtypes.get(path)
        return x.astype(dtype) if dtype is not None and is_floating_array(x) else x
    return jax.tree_util.tree_map_with_path(cast, tree)


# ----------------------------------------------------------------------------- loss scales
# The classes live in jaxopt_train.loss_scale (imported above); this module picks one per
# policy and applies updates only when the gradients are finite.


def loss_scale_for(policy: str | Policy) -> LossScale:
    """DynamicLossScale() when any of the policy's dtypes is float16 (its gradients then pass
    through float16: `Policy.needs_loss_scale`), else NoOpLossScale()."""
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
    if pred.dtype != jnp.bool_:  # 0.5 or nan would be read as True
        raise TypeError(f"pred must be a boolean (e.g. all_finite(grads)), got dtype {pred.dtype}")
    _check_leaves_match(on_true, on_false, "on_true", "on_false", dtypes=True)
    return jax.tree.map(lambda a, b: _select_leaf(pred, a, b), on_true, on_false)


def _select_leaf(pred, a, b):
    if hasattr(a, "dtype") or hasattr(b, "dtype"):
        # A Python number opposite an array (dtypes checked to match above) becomes an
        # array of the other side's dtype: lax.select takes arrays only.
        a = a if hasattr(a, "dtype") else jnp.asarray(a, b.dtype)
        b = b if hasattr(b, "dtype") else jnp.asarray(b, a.dtype)
        return jax.lax.select(pred, a, b)
    return a if a == b else _bad_static(a, b)


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
        missing, extra = leaf_path_diff(given, expected_def)
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


def _widen_to_param(grad, param):
    """`grad` in `param`'s dtype where that is wider (float32 for float16 against bfloat16)."""
    if not (is_floating_array(grad) and is_floating_array(param)) or grad.dtype == param.dtype:
        return grad
    grad_bits, param_bits = jnp.finfo(grad.dtype).bits, jnp.finfo(param.dtype).bits
    if param_bits > grad_bits:
        return grad.astype(param.dtype)
    return grad.astype(jnp.float32) if param_bits == grad_bits else grad


def apply_updates_if_finite(optimizer, grads, opt_state, params, loss_scale: LossScale,
                            *, rounding_seed=None, **extra_args):
    """Unscales `grads`, applies one optax step only if they are all finite.

    Args:
      optimizer: an `optax.GradientTransformation`.
      grads: gradients of the *scaled* loss (pytree like `params`); a leaf narrower
        than its param (float16 for float32 master weights) is widened to the
        param's dtype before it is unscaled.
      opt_state: the optimizer state.
      params: the (f32 master) parameters.
      loss_scale: the loss scale used for `grads`.
      rounding_seed: bf16 params (no f32 master copy) are updated in f32 and rounded
        back stochastically (`jaxopt_train.stochastic_round`) with bits hashed from
        each weight's values and this uint32, which must change every step. Default:
        from the optimizer state's step counts; an optimizer that has none (plain
        `optax.sgd`) with bf16 params is refused (ValueError): pass the step (with a
        constant seed a weight meeting the same update twice draws the same bits).
      **extra_args: passed on to `optimizer.update`, for transformations that
        take them (`optax.contrib.reduce_on_plateau` needs `value=loss`: give
        the unscaled loss, the scaled one moves with the loss scale).

    Returns:
      `(params, opt_state, loss_scale, grads_finite)`: when `grads_finite` is
      False, params and opt_state are the inputs unchanged and the loss scale
      has backed off / counted the skip.
    """
    import optax  # noqa: PLC0415

    if not isinstance(loss_scale, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        # None or a bare number (1024.0) otherwise failed deep inside with an AttributeError.
        raise TypeError(f"loss_scale={loss_scale!r} must be a NoOpLossScale, StaticLossScale or "
                        "DynamicLossScale, e.g. loss_scale_for(policy); for no scaling pass "
                        "NoOpLossScale(), for a fixed scale StaticLossScale(scale)")
    # optax would broadcast a (1,) or () gradient onto a (3,) param without a word.
    _check_leaves_match(grads, params, "grads", "params", dtypes=False)
    # Unscaled in float16 (which `unscale` returns for float16 leaves), a gradient below
    # ~6e-8, kept representable by the loss scale, flushes to 0 before the optimizer sees
    # it: widen to the params' dtype first, which the optimizer's arithmetic promotes to.
    grads = jax.tree.map(_widen_to_param, grads, params)
    grads = loss_scale.unscale(grads)
    finite = all_finite(grads)
    from jaxopt_train.stochastic_round import (  # noqa: PLC0415
        apply_updates,
        require_step_count,
        step_seed,
    )

    if rounding_seed is None:
        require_step_count(opt_state, params, "rounding_seed=<the step number, a uint32 that "
                                              "changes every step>")
    updates, new_opt_state = optimizer.update(grads, opt_state, params, **extra_args)
    # bf16 params (no f32 master copy) round stochastically: an update below half a bf16
    # step of its weight would be dropped whole by rounding to nearest.
    seed = step_seed(opt_state) if rounding_seed is None else rounding_seed
    new_params = apply_updates(params, updates, seed)
    params = select_tree(finite, new_params, params)
    opt_state = select_tree(finite, new_opt_state, opt_state)
    return params, opt_state, loss_scale.adjust(finite), finite
