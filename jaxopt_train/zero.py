"""ZeRO-style sharding over the data axis: stage 1 (optimizer state) and stage 3 (parameters too).

Parameters are laid out as one flat vector, padded to a multiple of the
number of devices n; device i owns elements `[i*s, (i+1)*s)` (s = padded/n)
of the parameters, of their gradient and of the optimizer state.

* Stage 0 (plain data parallel): everything replicated, gradients all-reduced.
* Stage 1: optimizer state sharded. Gradients are reduce-scattered (each
  device receives the sum of its own slice), each device updates its slice of
  the parameters with its slice of the optimizer state, and the new slices
  are all-gathered back into replicated parameters. Same bytes on the wire as
  an all-reduce (a reduce-scatter plus an all-gather), optimizer memory / n.
* Stage 3 (FSDP): parameters stay sharded between steps too; the step first
  all-gathers them, computes the gradient, reduce-scatters it and updates the
  slice. Parameter and optimizer memory / n, plus a transient full copy.

At stages 1 and 3 each device runs the optimizer on its slice alone, so it
must be elementwise (Adam, SGD): per-leaf masks, global-norm clipping and
trust ratios would see a slice, and `make_zero_step` refuses such optimizers
(`elementwise_mismatch`) rather than silently train differently.

Reduce-scatter and all-gather are the ring collectives of
`jaxopt_train.collectives` (`method="ring"`) or XLA's own
(`method="psum"`: `lax.psum_scatter` / `lax.all_gather`).

Per-leaf layout (the end of this module, used by `jaxopt-train bench train
--zero 1` and by the trainer's `--zero 1` and `--zero 3`): instead of one flat
vector, each leaf is split along one of its own dimensions (`shard_dim`), so
every leaf has its own all-gather and reduce-scatter, which XLA can overlap
with the forward and backward passes; leaves with no divisible dimension stay
replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train._trees import leaf_path_diff
from jaxopt_train.collectives import all_reduce_tree, ring_all_gather, ring_reduce_scatter
from jaxopt_train.collectives._axis import axis_size

STAGES = (0, 1, 3)
METHODS = ("psum", "ring")


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How a parameter pytree maps to one flat vector split into `num_shards` equal slices.

    Attributes:
      treedef: the parameter tree structure.
      shapes: shape of each leaf, in `jax.tree.leaves` order.
      dtype: the one dtype of every leaf (and of the flat vector).
      num_shards: devices sharing the vector.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    num_shards: int

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def shard_size(self) -> int:
        return -(-self.size // self.num_shards)

    @property
    def padded_size(self) -> int:
        return self.shard_size * self.num_shards

    def check(self, tree, what: str = "params", *, dtype: bool = True) -> None:
        """Raises ValueError unless `tree` has the layout's structure, leaf shapes and
        (with `dtype`) dtype.

        The message names the missing or unexpected leaf paths, or the first
        leaf whose shape or dtype differs, with what was expected.
        """
        given, treedef = jax.tree_util.tree_flatten_with_path(tree)
        fix = "pass a tree like the example params the layout (or ZeRO step) was built from"
        if treedef != self.treedef:
            missing, extra = map(sorted, leaf_path_diff(tree, self.treedef))
            raise ValueError(f"{what} do not have the layout's tree structure: missing leaves {missing}, "
                             f"unexpected leaves {extra}"
                             + ("" if missing or extra else f"; expected {self.treedef}, got {treedef}")
                             + f" ({fix})")
        for (path, leaf), want in zip(given, self.shapes):
            shape, leaf_dtype = tuple(np.shape(leaf)), np.dtype(jnp.result_type(leaf))
            if shape != want or (dtype and leaf_dtype != self.dtype):
                raise ValueError(f"{what} leaf {jax.tree_util.keystr(path)} has shape {shape} dtype "
                                 f"{leaf_dtype}; expected shape {want}"
                                 + (f" dtype {self.dtype}" if dtype else "") + f" ({fix})")

    def flatten(self, tree):
        """The leaves raveled, cast to the layout's dtype (gradients may be narrower),
        concatenated and zero-padded to `padded_size`."""
        self.check(tree, "tree", dtype=False)
        flat = jnp.concatenate([jnp.ravel(x).astype(self.dtype) for x in jax.tree.leaves(tree)])
        return jnp.pad(flat, (0, self.padded_size - self.size))

    def unflatten(self, flat):
        """Inverse of `flatten` (`flat` padded or not)."""
        if np.shape(flat) not in ((self.size,), (self.padded_size,)):
            raise ValueError(f"flat vector of shape {np.shape(flat)}; expected ({self.padded_size},) "
                             f"(padded) or ({self.size},) for this layout")
        leaves, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            leaves.append(flat[offset: offset + size].reshape(shape))
            offset += size
        return jax.tree.unflatten(self.treedef, leaves)


def make_layout(params, num_shards: int) -> FlatLayout:
    """The flat layout of `params` (all leaves one floating dtype) over `num_shards` devices."""
    leaves, treedef = jax.tree.flatten(params)
    dtypes = {np.dtype(x.dtype) for x in leaves}
    if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
        raise ValueError(f"ZeRO sharding needs parameters of one floating dtype; got {sorted(map(str, dtypes))} "
                         "(cast them to the param dtype first)")
    _check_num_shards(num_shards)
    return FlatLayout(treedef, tuple(tuple(x.shape) for x in leaves), dtypes.pop(), num_shards)


def _check_num_shards(num_shards: int) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{num_shards=} must be a positive int (the size of the data axis)")


def _check_axis_name(axis_name: str) -> None:
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"{axis_name=} must be a non-empty str naming the mesh axis (e.g. 'data')")


def _mesh_axis_size(mesh: jax.sharding.Mesh, axis_name: str) -> int:
    _check_axis_name(axis_name)
    if axis_name not in mesh.shape:
        raise ValueError(f"{axis_name=} is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}; "
                         "pass one of them as axis_name")
    return mesh.shape[axis_name]


def _check(stage: int, method: str):
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"{stage=} must be one of {STAGES} (0: replicated, 1: optimizer state, 3: + params)")
    if method not in METHODS:
        raise ValueError(f"{method=} must be one of {METHODS}")


def reduce_scatter_grads(grads, layout: FlatLayout, axis_name: str, method: str = "ring"):
    """Inside shard_map: this device's slice [shard_size] of the SUM of every device's gradient tree."""
    flat = layout.flatten(grads)
    if method == "ring":
        return ring_reduce_scatter(flat, axis_name)
    return lax.psum_scatter(flat, axis_name, scatter_dimension=0, tiled=True)


def gather_params(param_slice, layout: FlatLayout, axis_name: str, method: str = "ring"):
    """Inside shard_map: the full parameter tree from every device's slice."""
    if method == "ring":
        return layout.unflatten(ring_all_gather(param_slice, axis_name))
    return layout.unflatten(lax.all_gather(param_slice, axis_name, axis=0, tiled=True))


def local_slice(flat, layout: FlatLayout, axis_name: str):
    """Inside shard_map: this device's slice of a replicated flat vector."""
    start = lax.axis_index(axis_name) * layout.shard_size
    return lax.dynamic_slice_in_dim(flat, start, layout.shard_size)


def opt_state_specs(optimizer: optax.GradientTransformation, layout: FlatLayout, axis_name: str = "data"):
    """PartitionSpecs of the optimizer state of one slice: slice-shaped leaves P(axis), the rest P()."""
    abstract = jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((layout.shard_size,), layout.dtype))
    return jax.tree.map(lambda x: P(axis_name) if x.shape[:1] == (layout.shard_size,) else P(), abstract)


class ZeroState(NamedTuple):
    """params: a replicated tree (stages 0, 1) or the flat vector sharded P(axis) (stage 3).
    opt_state: replicated (stage 0) or per-slice state sharded over the axis (stages 1, 3)."""

    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class ZeroStep:
    """`init(params) -> ZeroState` and jitted `step(state, batch) -> (state, loss)` for one stage.

    `batch` leaves are sharded P(axis) along dimension 0; `loss_fn(params,
    local_batch)` is the mean loss over a device's part of the batch.
    """

    init: Callable
    step: Callable
    layout: FlatLayout
    state_specs: ZeroState


def make_zero_step(loss_fn: Callable, optimizer: optax.GradientTransformation, params,
                   mesh: jax.sharding.Mesh, *, stage: int, axis_name: str = "data",
                   method: str = "ring") -> ZeroStep:
    """Builds the data-parallel SGD step of one ZeRO stage (see the module docstring).

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar` mean over the local batch.
      optimizer: an optax transformation. Stages 1 and 3 run it on a 1-D
        slice of the flattened tree, so it must be elementwise with nothing
        tree-structured (Adam, SGD, unmasked AdamW); they then give stage 0's
        result. Stage 0 takes any optimizer.
      params: example parameters (shapes and dtype).
      mesh: mesh with `axis_name`.
      stage: 0, 1 or 3.
      method: "ring" (ppermute rings) or "psum" (XLA collectives).

    `init(params)` raises ValueError unless `params` has the example params'
    structure, leaf shapes and dtype.

    Raises:
      ValueError: at stages 1 and 3, for an optimizer whose update of slices
        differs from its update of the whole tree (per-leaf masks, global-norm
        clipping, trust ratios; `elementwise_mismatch` runs it on a small
        random surrogate of `params` to tell).
    """
    _check(stage, method)
    n = _mesh_axis_size(mesh, axis_name)
    layout = make_layout(params, n)
    mismatch = elementwise_mismatch(optimizer, params, n) if stage else None
    if mismatch:
        raise ValueError(
            f"{stage=} runs the optimizer on each device's 1-D slice of the flattened parameters, "
            "so it must be elementwise with nothing tree-structured: no per-leaf masks or labels "
            "(e.g. AdamW's weight-decay mask, optax.multi_transform), no global-norm clipping, no "
            f"per-leaf trust ratios (optax.lamb, optax.lars); this optimizer is not ({mismatch}). "
            "Use stage=0, an optimizer without those parts, or the per-leaf layout (the trainer's "
            "zero=1|3), whose shards keep each leaf's rank and the tree's structure")
    slice_specs = opt_state_specs(optimizer, layout, axis_name)
    param_spec = P(axis_name) if stage == 3 else jax.tree.map(lambda _: P(), params)
    opt_spec = jax.tree.map(lambda _: P(), jax.eval_shape(optimizer.init, params)) if stage == 0 else slice_specs
    specs = ZeroState(param_spec, opt_spec)
    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))  # noqa: E731

    def update(grad, opt_state, param):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            updates, opt_state = optimizer.update(grad, opt_state, param)
        return optax.apply_updates(param, updates), opt_state

    def per_device(state: ZeroState, batch):
        full = gather_params(state.params, layout, axis_name, method) if stage == 3 else state.params
        loss, grads = jax.value_and_grad(loss_fn)(full, batch)
        loss = lax.pmean(loss, axis_name)
        if stage == 0:
            grads = all_reduce_tree(grads, axis_name, method=method)
            grads = jax.tree.map(lambda g: g / n, grads)
            return ZeroState(*update(grads, state.opt_state, full)), loss
        grad_slice = reduce_scatter_grads(grads, layout, axis_name, method) / n
        own = state.params if stage == 3 else local_slice(layout.flatten(full), layout, axis_name)
        new_slice, opt_state = update(grad_slice, state.opt_state, own)
        new_params = new_slice if stage == 3 else gather_params(new_slice, layout, axis_name, method)
        return ZeroState(new_params, opt_state), loss

    step = smap(per_device, (specs, P(axis_name)), (specs, P()))

    def init(params) -> ZeroState:
        layout.check(params)
        if stage == 0:
            replicated = jax.device_put(params, NamedSharding(mesh, P()))
            return ZeroState(replicated, jax.jit(optimizer.init)(replicated))
        flat = jax.device_put(layout.flatten(params), NamedSharding(mesh, P(axis_name)))
        opt_state = smap(optimizer.init, P(axis_name), slice_specs)(flat)
        kept = flat if stage == 3 else jax.device_put(params, NamedSharding(mesh, P()))
        return ZeroState(kept, opt_state)

    return ZeroStep(init=init, step=step, layout=layout, state_specs=specs)


def shard_dim(shape: tuple[int, ...], num_shards: int) -> int | None:
    """The dimension of `shape` that per-leaf sharding splits over `num_shards` devices, or None.

    The FIRST dimension divisible by `num_shards`, not the largest: every
    divisible choice saves the same memory (1/n of the leaf), and the first is
    usually dimension 0, whose shards are contiguous blocks of a row-major
    array, so all-gathers and reduce-scatters over it move whole blocks with
    no transposes. None (keep the leaf replicated) for scalars and for shapes
    with no divisible dimension.
    """
    _check_num_shards(num_shards)
    for dim, size in enumerate(shape):
        if size % num_shards == 0 and size >= num_shards:
            return dim
    return None


def leaf_spec(shape: tuple[int, ...], num_shards: int, axis_name: str = "data") -> P:
    """P sharding `shard_dim(shape, num_shards)` over the axis, else P() (replicated)."""
    _check_axis_name(axis_name)
    dim = shard_dim(shape, num_shards)
    return P() if dim is None else P(*([None] * dim + [axis_name]))


def zero_shardings(params, opt_state, mesh: jax.sharding.Mesh, *, stage: int, axis_name: str = "data"):
    """NamedShardings (params, opt_state) for `jax.jit`-managed ZeRO without flattening.

    Each leaf is sharded over `axis_name` along its first divisible dimension
    (stage 1: optimizer state only; stage 3: parameters too); XLA then inserts
    the reduce-scatter / all-gather itself. Leaves with no divisible dimension
    stay replicated.
    """
    _check(stage, "psum")
    n = _mesh_axis_size(mesh, axis_name)
    sharded = lambda tree: jax.tree.map(  # noqa: E731
        lambda spec: NamedSharding(mesh, spec), leaf_specs(tree, n, axis_name))
    replicated = lambda tree: jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)  # noqa: E731
    return (sharded(params) if stage == 3 else replicated(params),
            replicated(opt_state) if stage == 0 else sharded(opt_state))


# Per-leaf ZeRO-1 -----------------------------------------------------------
#
# The flat layout above moves the whole model in ONE reduce-scatter and ONE
# all-gather, which can start only once every gradient exists (and end before
# any parameter is used). Splitting each leaf along one of its own dimensions
# gives one collective per leaf instead: a leaf's reduce-scatter can start as
# soon as the backward has produced its gradient, and a leaf's all-gather needs
# to finish only before the forward first reads it. XLA's latency-hiding
# scheduler then overlaps them with compute. No flattening copies, no padding.


def spec_dim(spec: P, axis_name: str = "data") -> int | None:
    """The dimension `spec` shards over `axis_name`, or None (replicated).

    Raises:
      ValueError: if `spec` is not a PartitionSpec, or names an axis other than
        `axis_name` (a leaf sharded over another axis is not replicated over this one).
    """
    _check_axis_name(axis_name)
    if not isinstance(spec, P):
        raise ValueError(f"{spec=} must be a jax.sharding.PartitionSpec, e.g. from leaf_specs")
    if any(name not in (None, axis_name) for name in spec):
        raise ValueError(f"{spec=} names an axis other than {axis_name=}; the per-leaf specs must "
                         f"shard over {axis_name!r} only (leaf_specs(..., axis_name={axis_name!r}))")
    return next((dim for dim, name in enumerate(spec) if name == axis_name), None)


def leaf_specs(params, num_shards: int, axis_name: str = "data"):
    """PartitionSpec tree (the structure of `params`): each leaf split along its `shard_dim`.

    Leaves with no dimension divisible by `num_shards` get P(): they stay
    replicated, their gradient is all-reduced and every device updates them.
    """
    _check_num_shards(num_shards)
    _check_axis_name(axis_name)
    return jax.tree.map(lambda x: leaf_spec(tuple(jnp.shape(x)), num_shards, axis_name), params)


def opt_state_leaf_specs(optimizer: optax.GradientTransformation, opt_state, params, param_specs):
    """PartitionSpec tree of `opt_state` matching `param_specs`.

    Every copy of the parameter tree inside the state (Adam's mu and nu) gets
    the parameters' specs; everything else (step counts) stays replicated.
    Copies are found with `optax.tree_utils.tree_map_params` (the optimizer's
    init run on a placeholder). Only elementwise optimizers (Adam, AdamW, SGD)
    give the replicated result when each device updates its shard; ones that
    mix elements across a leaf or the tree (global-norm clipping, factored
    moments) do not, and the latter are refused here.

    Args:
      optimizer: the optax transformation that built `opt_state`.
      opt_state: its state for `params` (arrays or `jax.ShapeDtypeStruct`s).
      params: the full parameters (shapes only are read).
      param_specs: `leaf_specs(params, ...)`.

    Raises:
      ValueError: if the parameter copies cannot be found, or a matched state
        leaf has another shape than its parameter (it cannot be split alike).
    """
    mismatched = []

    def match(leaf, spec, param):
        if tuple(leaf.shape) != tuple(param.shape):
            mismatched.append(f"{tuple(leaf.shape)} vs param {tuple(param.shape)}")
        return spec

    try:
        specs = optax.tree_utils.tree_map_params(optimizer, match, opt_state, param_specs, params,
                                                 transform_non_params=lambda _: P())
    except (TypeError, AttributeError, ValueError) as err:
        raise ValueError("per-leaf ZeRO could not match the optimizer state to the parameters "
                         f"({type(err).__name__}: {err}); it needs an elementwise optax optimizer "
                         "whose state holds parameter-shaped trees (e.g. optax.adamw), else use zero=0"
                         ) from err
    if mismatched:
        raise ValueError(f"per-leaf ZeRO: optimizer state leaves shaped {mismatched} do not have their "
                         "parameter's shape, so they cannot be split like it; use an elementwise "
                         "optimizer (e.g. optax.adamw) or zero=0")
    return specs


def place_leaves(tree, specs, mesh: jax.sharding.Mesh):
    """`tree` (e.g. a replicated state) put on `mesh` with `NamedSharding(mesh, spec)` per leaf."""
    return jax.device_put(tree, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))


def gather_leaves(shards, specs, axis_name: str = "data"):
    """Inside shard_map: the full leaves from every device's shard (an all-gather per leaf).

    Replicated leaves (spec without `axis_name`) are returned as they are.

    Raises:
      ValueError: outside shard_map over `axis_name`, or for a spec that is not
        a PartitionSpec or names another axis (see `spec_dim`).
    """
    axis_size(axis_name)  # a clear error when the axis is not bound here

    def gather(shard, spec):
        dim = spec_dim(spec, axis_name)
        return shard if dim is None else lax.all_gather(shard, axis_name, axis=dim, tiled=True)

    return jax.tree.map(gather, shards, specs)


def reduce_scatter_leaves(grads, specs, axis_name: str = "data", method: str = "psum"):
    """Inside shard_map: per leaf, this device's shard of the SUM of every device's `grads`.

    Sharded leaves: one `lax.psum_scatter` each, along their spec's dimension.
    Replicated leaves are summed whole, together, by
    `all_reduce_tree(method=method)` (every device then holds the full sum).
    Raises ValueError like `gather_leaves`.
    """
    axis_size(axis_name)  # a clear error when the axis is not bound here
    leaves, treedef = jax.tree.flatten(grads)
    dims = [spec_dim(spec, axis_name) for spec in treedef.flatten_up_to(specs)]
    out = [g if dim is None else lax.psum_scatter(g, axis_name, scatter_dimension=dim, tiled=True)
           for g, dim in zip(leaves, dims)]
    whole = [i for i, dim in enumerate(dims) if dim is None]
    if whole:
        summed = all_reduce_tree([leaves[i] for i in whole], axis_name, method=method)
        for i, g in zip(whole, summed):
            out[i] = g
    return jax.tree.unflatten(treedef, out)


# Is the optimizer elementwise? ----------------------------------------------
#
# Stages 1 and 3 run the optimizer on each device's shard on its own, which
# equals the replicated update only if the optimizer's math is per parameter.
# An optax optimizer is opaque (a mask or a global norm hides in a closure), so
# the check runs it: two updates of a small random surrogate of the params,
# once on the whole tree and once per shard (vmapped, so each call sees one
# shard's shapes, as a device does), and compares them.


def _surrogate_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
    # Same rank, at most 3 per dimension; the split dimension keeps 1-2 rows per shard.
    return tuple(num_shards * min(size // num_shards, 2) if d == dim else min(size, 3)
                 for d, size in enumerate(shape))


def _two_updates(optimizer: optax.GradientTransformation, params, grads):
    state, out = optimizer.init(params), []
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def elementwise_mismatch(optimizer: optax.GradientTransformation, params, num_shards: int,
                         specs=None, axis_name: str = "data") -> str | None:
    """None if updating shards alone equals updating the whole tree, else where it differs.

    Args:
      optimizer: the optax transformation to test.
      params: the parameters (only the tree structure, ranks and dtypes are read).
      num_shards: devices sharing the parameters.
      specs: `leaf_specs(params, ...)` for the per-leaf layout (shards keep each
        leaf's rank and the tree's structure); None for the flat layout (each
        shard is one 1-D slice of the flattened tree).

    Shape-specific behaviour beyond rank (a mask on one leaf's exact size) is
    not reproduced by the small surrogate and so not detected.
    """
    leaves, treedef = jax.tree.flatten(params)
    dims = ([None] * len(leaves) if specs is None
            else [spec_dim(s, axis_name) for s in treedef.flatten_up_to(specs)])
    rng = np.random.default_rng(0)

    def draw(scale):  # large gradients, so a clip by any usual norm is active
        return treedef.unflatten([
            jnp.asarray(rng.normal(size=_surrogate_shape(tuple(np.shape(x)), d, num_shards)) * scale,
                        x.dtype) for x, d in zip(leaves, dims)])

    p, grads = draw(1.0), [draw(100.0), draw(100.0)]
    if specs is None:
        layout = make_layout(p, num_shards)
        split = lambda t: layout.flatten(t).reshape(num_shards, -1)  # noqa: E731
        join = lambda u: layout.unflatten(u.reshape(-1))  # noqa: E731
    else:
        split = lambda t: treedef.unflatten([  # noqa: E731
            jnp.broadcast_to(x, (num_shards, *x.shape)) if d is None
            else jnp.stack(jnp.split(x, num_shards, axis=d)) for x, d in zip(jax.tree.leaves(t), dims)])
        join = lambda u: treedef.unflatten([  # noqa: E731  (replicated leaves keep every copy)
            x if d is None else jnp.concatenate(list(x), axis=d) for x, d in zip(jax.tree.leaves(u), dims)])

    @jax.jit
    def both(p, grads):
        whole = _two_updates(optimizer, p, grads)
        shards = jax.vmap(lambda p, g: _two_updates(optimizer, p, g))(split(p), [split(g) for g in grads])
        return whole, [join(u) for u in shards]

    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        whole, sharded = both(p, grads)
    for step, (w, s) in enumerate(zip(whole, sharded)):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(s)):
            rtol = 1e-4 if np.dtype(a.dtype).itemsize >= 4 else 1e-2
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            scale = float(np.max(np.abs(a), initial=0.0))
            diff = float(np.max(np.abs(b - a), initial=0.0))  # b broadcasts for replicated leaves
            if not diff <= rtol * scale + 1e-7:
                return (f"on random gradients, update {step + 1} of leaf {jax.tree_util.keystr(path)} "
                        f"differs by up to {diff:.3g} (updates up to {scale:.3g}) when each of "
                        f"{num_shards} shards is updated on its own")
    return None
