"""Is an optax optimizer elementwise, so that ZeRO stages 1 and 3 may run it on shards?

Stages 1 and 3 run the optimizer on each device's shard on its own, which
equals the replicated update only if the optimizer's math is per parameter.
An optax optimizer is opaque (a mask or a global norm hides in a closure), so
the check runs it: `STEPS` updates of small random surrogates of the params,
once on the whole tree and once per shard (vmapped, so each call sees one
shard's shapes, as a device does), and compares them relative to the updates'
size (a warmup from lr 0 makes them tiny). An optimizer that fails on a
shard (a mask shaped like the tree, on a 1-D slice) is reported too.

The gradients are correlated (one random direction plus noise), and there are
enough of them, for learning-rate-free optimizers to move their step size:
Prodigy's and D-Adaptation's sum over the whole tree, but on two independent
gradients their estimate stays at its initial value (updates 1-4 match
exactly; Prodigy's first moves in update 5).

With `nonfinite=True` a third run puts a NaN into one gradient element of one
shard: an optimizer that decides on the whole update whether to apply it
(`optax.apply_if_finite`) skips the step everywhere on the whole tree but only
on that shard when sharded, so the shards part. An elementwise optimizer keeps
the NaN in that element alone, in both runs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxopt_train.zero._checks import _check_has_leaves, _check_num_shards
from jaxopt_train.zero.layout import make_layout
from jaxopt_train.zero.leaves import spec_dim


def _surrogate_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
    # Same rank, at most 3 per dimension; the split dimension keeps 1-2 rows per shard.
    return tuple(num_shards * min(size // num_shards, 2) if d == dim else min(size, 3)
                 for d, size in enumerate(shape))


# Updates compared per run. Prodigy's step size first moves in update 5 on these gradients
# (6: one to spare). The steps are a scan: more cost run time only, which is tiny.
STEPS = 6

# Both programs at LLVM -O0, as XLA:CPU compiles them at: whatever XLA's default level does to
# the whole-tree and the vmapped program (e.g. contracting a*b+c into an FMA in one only) rounds
# them apart. A schedule-free optimizer's updates are differences of params, which at params of
# ~1e3 carry only an ulp of 6e-5 against updates of ~8e-4: at the default level the shard run of
# schedule_free_adamw differed by 1.2e-4 (15%), at -O0 by nothing. -O0 also compiles faster.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# XLA:CPU's fusion emitters too, where this jaxlib still has the older elemental ones as an
# option (0.10's `--xla_cpu_use_fusion_emitters=false`, which the test suite runs with): those
# round the two programs' param differences an ulp apart again (schedule_free_adamw, params of
# ~1e3: update 2 differed by 1.2e-4). jaxlib 0.11.2 does not know the flag (XLA_FLAGS aborts on
# it); a jaxlib that refuses the compile option by name runs the check at -O0 alone.
_EMITTER_OPTION = {"xla_cpu_use_fusion_emitters": True}


@functools.cache
def _compiler_options() -> dict:
    """`_COMPILER_OPTIONS`, plus `_EMITTER_OPTION` if this jaxlib knows it (one tiny compile)."""
    options = {**_COMPILER_OPTIONS, **_EMITTER_OPTION}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except Exception as err:  # noqa: BLE001  (jaxlib's runtime error type moved between versions)
        if "No such compile option" not in str(err):
            raise
        return dict(_COMPILER_OPTIONS)
    return options


def _check_device():
    """This process's CPU device (so the check rounds alike on every machine), or None if jax
    has no CPU backend here (JAX_PLATFORMS without cpu): then the default device. Local: with
    several processes, jax.devices("cpu")[0] is process 0's, which the others cannot run on."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def _strong(x, like):
    """`x` with `like`'s dtype and no weak type: a scan carry must keep its exact type, and optax
    may init a Python-float scalar (weakly typed) that its update returns strongly typed."""
    if not hasattr(like, "dtype") or jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
        return x
    return lax.convert_element_type(x, like.dtype)


def _updates(optimizer: optax.GradientTransformation, params, grads):
    """The updates of one step per row of `grads` (leaves stacked on axis 0), from `params`.

    A scan, not a Python loop: compiled once, whatever `STEPS` is."""
    def step(carry, g):
        params, state = carry
        updates, new_state = optimizer.update(g, state, params)
        new_state = jax.tree.map(_strong, new_state, state)
        return (optax.apply_updates(params, updates), new_state), updates

    state = optimizer.init(params)
    return lax.scan(step, (params, jax.tree.map(_strong, state, state)), grads)[1]


def elementwise_mismatch(optimizer: optax.GradientTransformation, params, num_shards: int,
                         specs=None, axis_name: str = "data", *,
                         nonfinite: bool = False) -> str | None:
    """None if updating shards alone equals updating the whole tree, else where it differs.

    Args:
      optimizer: the optax transformation to test.
      params: the parameters (only the tree structure, ranks and dtypes are read; floats
        narrower than float32 are checked in float32: `_check_dtype`).
      num_shards: devices sharing the parameters.
      specs: `leaf_specs(params, ...)` for the per-leaf layout (shards keep each
        leaf's rank and the tree's structure); None for the flat layout (each
        shard is one 1-D slice of the flattened tree).
      nonfinite: also compare the updates of gradients with a NaN in one
        shard (see the module docstring), for a step that applies whatever the
        optimizer returns. A step that skips a non-finite gradient on every
        device alike itself (the trainer's) does not need it.

    Shape-specific behaviour beyond rank (a mask on one leaf's exact size) is
    not reproduced by the small surrogate and so not detected.

    Raises:
      ValueError: if `params` has no leaves.
    """
    _check_has_leaves(jax.tree.leaves(params), "params")
    _check_num_shards(num_shards)  # 0 divided by zero in the per-leaf surrogate shapes
    with jax.default_device(_check_device()):
        return _mismatch(optimizer, params, num_shards, specs, axis_name, nonfinite)


def _with_nan(grads, dims):
    """`grads` with a NaN in the first element of update 1 of the first leaf that is split (in
    shard 0), or None if every leaf is replicated (each shard then sees the whole NaN)."""
    split = [i for i, (g, d) in enumerate(zip(grads, dims)) if d is not None and g[0].size]
    if not split:
        return None
    out = list(grads)
    out[split[0]] = out[split[0]].copy()
    out[split[0]][(0,) * out[split[0]].ndim] = np.nan
    return out


def _check_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a leaf's surrogate is checked in: float32 for the floats narrower than it.
    The check asks whether the optimizer's math is per element, which no dtype changes; in
    bfloat16 the two programs' rounding alone parts them by a percent: on jaxlib 0.11.2
    sgd + momentum's bf16 update 5 differed by 1.04% (1.91e-6 of 1.83e-4; a momentum kept
    in bf16 carries each step's rounding on), over the 1% a bf16 tolerance could allow and
    still see a mask's 10%. In float32 the rounding is ~1e-7 of the updates."""
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _mismatch(optimizer, params, num_shards: int, specs, axis_name: str,
              nonfinite: bool) -> str | None:
    leaves, treedef = jax.tree.flatten(params)
    dims = ([None] * len(leaves) if specs is None
            else [spec_dim(s, axis_name) for s in treedef.flatten_up_to(specs)])
    shapes = [_surrogate_shape(tuple(np.shape(x)), d, num_shards) for x, d in zip(leaves, dims)]
    dtypes = [_check_dtype(np.dtype(jnp.result_type(x))) for x in leaves]  # Python floats too
    rng = np.random.default_rng(0)

    # Host (numpy) surrogates, split and joined on the host: the compiled program holds only
    # the optimizer's math, whose compile time the check is made of.
    def draw(scale, steps=None):  # large gradients, so a clip by any usual norm is active
        lead = () if steps is None else (steps,)
        return [rng.normal(size=lead + shape) * scale for shape in shapes]

    # One direction plus noise half its size, per step: a learning-rate-free optimizer's
    # estimate grows only while successive gradients agree (`STEPS`).
    grads = [(d + noise).astype(dtype)
             for d, noise, dtype in zip(draw(100.0), draw(50.0, STEPS), dtypes)]
    if specs is None:
        layout = make_layout(treedef.unflatten([jax.ShapeDtypeStruct(sh, dt) for sh, dt in
                                                zip(shapes, dtypes)]), num_shards)
        split, join = _flat_split_join(layout)
        shard_tree = lambda leaves: leaves[0]  # noqa: E731  (a shard is one 1-D slice)
    else:
        split, join = _leaf_split_join(dims, num_shards)
        shard_tree = treedef.unflatten

    @functools.partial(jax.jit, compiler_options=_compiler_options())
    def both(p, grads, p_shards, grad_shards):
        whole = _updates(optimizer, treedef.unflatten(p), treedef.unflatten(grads))
        shards = jax.vmap(lambda p, g: _updates(optimizer, shard_tree(p), shard_tree(g)))(
            p_shards, grad_shards)  # [shard, step, ...]
        return jax.tree.leaves(whole), jax.tree.leaves(shards)

    # Params near 1 show a global norm or trust ratio; params of ~1e3 make a weight decay of
    # any usual factor (optax's default 1e-4 too) outweigh rounding, so a per-leaf mask that a
    # shard sees wrongly shows. Later runs reuse the first's compilation.
    runs = [(1.0, grads, ""), (1e3, grads, "")]
    # The flat layout's first leaf starts shard 0; per leaf, shard 0 holds index 0 of the split dim.
    nan_grads = _with_nan(grads, [0] * len(grads) if specs is None else dims) if nonfinite else None
    if nan_grads is not None:
        runs.append((1.0, nan_grads, " with a NaN in one gradient element of one shard"))
    for param_scale, run_grads, note in runs:
        p = [x.astype(dtype) for x, dtype in zip(draw(param_scale), dtypes)]
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            try:
                whole, sharded = both(p, run_grads, split(p), split(run_grads, 1))
            except Exception as err:  # noqa: BLE001  (e.g. a mask tree that a 1-D slice cannot match)
                jax.jit(lambda p, g: _updates(optimizer, treedef.unflatten(p), treedef.unflatten(g)),
                        compiler_options=_compiler_options())(p, run_grads)  # its own errors raise
                cause = " ".join(str(err).split())
                return (f"running it on one shard's parameters fails: {type(err).__name__}: "
                        f"{cause[:300]}{'...' if len(cause) > 300 else ''}")
        whole, sharded = [np.asarray(u) for u in whole], [np.asarray(u) for u in sharded]
        mismatch = _first_difference(
            [treedef.unflatten([u[i] for u in whole]) for i in range(STEPS)],
            [treedef.unflatten(join([u[:, i] for u in sharded])) for i in range(STEPS)],
            num_shards, f"params of size ~{param_scale:g}{note}")
        if mismatch:
            return mismatch
    return None


def _flat_split_join(layout):
    """(split, join) on the host for the flat layout: leaves (with `lead` leading step axes)
    to the [num_shards, (steps,) shard_size] slices of their flat vector, and back."""
    def split(leaves, lead=0):
        flat = np.concatenate([x.reshape(*x.shape[:lead], -1).astype(layout.dtype) for x in leaves],
                              axis=lead)
        flat = np.pad(flat, [(0, 0)] * lead + [(0, layout.padded_size - layout.size)])
        return [np.moveaxis(flat.reshape(*flat.shape[:lead], layout.num_shards, -1), lead, 0)]

    def join(shards):
        flat, out, offset = shards[0].reshape(-1), [], 0
        for shape in layout.shapes:
            out.append(flat[offset: offset + math.prod(shape)].reshape(shape))
            offset += math.prod(shape)
        return out

    return split, join


def _leaf_split_join(dims, num_shards: int):
    """(split, join) on the host for the per-leaf layout: each leaf split along its dimension
    (after `lead` leading step axes) into [num_shards, ...] shards, or copied if replicated."""
    def split(leaves, lead=0):
        return [np.broadcast_to(x, (num_shards, *x.shape)) if d is None
                else np.stack(np.split(x, num_shards, axis=lead + d)) for x, d in zip(leaves, dims)]

    def join(shards):  # replicated leaves keep every copy
        return [x if d is None else np.concatenate(list(x), axis=d) for x, d in zip(shards, dims)]

    return split, join


def _first_difference(whole, sharded, num_shards: int, setting: str) -> str | None:
    for step, (w, s) in enumerate(zip(whole, sharded)):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(s)):
            # 1e-3 (the floats are f32 or wider: `_check_dtype`), not less: a schedule-free
            # optimizer's updates are differences of params, which two programs round apart by
            # an ulp of the params (~1.5e-4 of the update here); what the check must catch
            # differs by percents (a per-shard clip, a mask a 1-D slice gets wrong: a weight
            # decay ~10% of the update at ~1e3).
            rtol = 1e-3
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            # A NaN gradient leaves NaNs (or infs) in the updates: they must be where the whole
            # tree's are; the finite rest is compared below.
            finite_a, finite_b = np.isfinite(a), np.isfinite(b)
            if np.any(finite_a != finite_b):
                return (f"on correlated random gradients and {setting}, update {step + 1} of leaf "
                        f"{jax.tree_util.keystr(path)} has non-finite values in other elements "
                        f"when each of {num_shards} shards is updated on its own")
            a, b = np.where(finite_a, a, 0.0), np.where(finite_b, b, 0.0)
            scale = float(np.max(np.abs(a), initial=0.0))
            diff = float(np.max(np.abs(b - a), initial=0.0))  # b broadcasts for replicated leaves
            # Relative to the updates with no absolute floor: a warmup from lr 0 makes them
            # tiny (update 2 of warmup_cosine_decay_schedule(0, 3e-4, 2000, ...) is ~1e-7),
            # and a floor would pass the differences below it. Updates of exactly 0 (lr 0) must
            # match exactly.
            if not diff <= rtol * scale:
                return (f"on correlated random gradients and {setting}, update "
                        f"{step + 1} of leaf {jax.tree_util.keystr(path)} differs by up to "
                        f"{diff:.3g} (updates up to {scale:.3g}) when each of {num_shards} shards "
                        "is updated on its own")
    return None
