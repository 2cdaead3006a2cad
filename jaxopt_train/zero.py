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

Reduce-scatter and all-gather are the ring collectives of
`jaxopt_train.collectives` (`method="ring"`) or XLA's own
(`method="psum"`: `lax.psum_scatter` / `lax.all_gather`).
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

from jaxopt_train.collectives import all_reduce_tree, ring_all_gather, ring_reduce_scatter

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

    def flatten(self, tree):
        """The leaves raveled, concatenated and zero-padded to `padded_size`."""
        flat = jnp.concatenate([jnp.ravel(x).astype(self.dtype) for x in jax.tree.leaves(tree)])
        return jnp.pad(flat, (0, self.padded_size - self.size))

    def unflatten(self, flat):
        """Inverse of `flatten`."""
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
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{num_shards=} must be a positive int (the size of the data axis)")
    return FlatLayout(treedef, tuple(tuple(x.shape) for x in leaves), dtypes.pop(), num_shards)


def _check(stage: int, method: str):
    if stage not in STAGES:
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
      optimizer: any optax transformation (elementwise ones, e.g. Adam, give
        the same result at every stage; ones that mix elements across the
        tree, e.g. global-norm clipping, see only a slice at stages 1 and 3).
      params: example parameters (shapes and dtype).
      mesh: mesh with `axis_name`.
      stage: 0, 1 or 3.
      method: "ring" (ppermute rings) or "psum" (XLA collectives).
    """
    _check(stage, method)
    n = mesh.shape[axis_name]
    layout = make_layout(params, n)
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
        if stage == 0:
            replicated = jax.device_put(params, NamedSharding(mesh, P()))
            return ZeroState(replicated, jax.jit(optimizer.init)(replicated))
        flat = jax.device_put(layout.flatten(params), NamedSharding(mesh, P(axis_name)))
        opt_state = smap(optimizer.init, P(axis_name), slice_specs)(flat)
        kept = flat if stage == 3 else jax.device_put(params, NamedSharding(mesh, P()))
        return ZeroState(kept, opt_state)

    return ZeroStep(init=init, step=step, layout=layout, state_specs=specs)


def leaf_spec(shape: tuple[int, ...], num_shards: int, axis_name: str = "data") -> P:
    """P sharding the first dimension of `shape` divisible by `num_shards` over the axis, else P()."""
    for dim, size in enumerate(shape):
        if size % num_shards == 0 and size >= num_shards:
            return P(*([None] * dim + [axis_name]))
    return P()


def zero_shardings(params, opt_state, mesh: jax.sharding.Mesh, *, stage: int, axis_name: str = "data"):
    """NamedShardings (params, opt_state) for `jax.jit`-managed ZeRO without flattening.

    Each leaf is sharded over `axis_name` along its first divisible dimension
    (stage 1: optimizer state only; stage 3: parameters too); XLA then inserts
    the reduce-scatter / all-gather itself. Leaves with no divisible dimension
    stay replicated.
    """
    _check(stage, "psum")
    n = mesh.shape[axis_name]
    sharded = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: NamedSharding(mesh, leaf_spec(tuple(jnp.shape(x)), n, axis_name)), tree)
    replicated = lambda tree: jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)  # noqa: E731
    return (sharded(params) if stage == 3 else replicated(params),
            replicated(opt_state) if stage == 0 else sharded(opt_state))
