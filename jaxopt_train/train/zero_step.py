"""ZeRO stages 1 and 3 inside the trainer's step (see `jaxopt_train.zero` for the idea).

The layout differs from `jaxopt_train.zero.FlatLayout` in one way that the
trainer needs: device i's slice is the i-th chunk of EVERY leaf (each leaf
raveled, zero-padded to a multiple of n and cut into n chunks), so a slice
unflattens into a pytree with the parameters' own structure. Optimizers that
take per-leaf masks (AdamW's weight-decay mask) then work on slices
unchanged; chunks keep their leaf's rank (shape (1, ..., 1, chunk)) so a mask
computed from `ndim` stays right. Still one reduce-scatter and one all-gather
per optimizer step, over a single flat vector.

Global-norm clipping cannot live in the optimizer at stages 1 and 3 (it would
see one slice): the step clips the gradient slice itself with the norm of the
whole gradient (psum of squared slice norms), with optax's formula.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import accumulate_gradients
from jaxopt_train.precision import all_finite, select_tree
from jaxopt_train.train.state import TrainState
from jaxopt_train.zero import gather_params, local_slice, reduce_scatter_grads

AXIS = "data"
ZERO_STAGES = (0, 1, 3)
# grad_sync -> the reduce-scatter / all-gather method of jaxopt_train.zero.
ZERO_METHODS = {"psum": "psum", "ring": "ring"}


@dataclasses.dataclass(frozen=True)
class ChunkedLayout:
    """Params <-> a flat vector [n * shard_size] whose i-th slice holds chunk i of every leaf."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    num_shards: int

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(-(-math.prod(s) // self.num_shards) for s in self.shapes)

    @property
    def shard_size(self) -> int:
        return sum(self.chunks)

    def flatten(self, tree):
        """[n * shard_size]: row i (of the [n, shard_size] view) is device i's slice."""
        rows = []
        for x, chunk in zip(jax.tree.leaves(tree), self.chunks):
            flat = jnp.ravel(x).astype(self.dtype)
            rows.append(jnp.pad(flat, (0, chunk * self.num_shards - flat.size)).reshape(self.num_shards, chunk))
        return jnp.concatenate(rows, axis=1).reshape(-1)

    def unflatten(self, flat):
        rows = flat.reshape(self.num_shards, self.shard_size)
        leaves, offset = [], 0
        for shape, chunk in zip(self.shapes, self.chunks):
            leaf = rows[:, offset: offset + chunk].reshape(-1)[: math.prod(shape)]
            leaves.append(leaf.reshape(shape))
            offset += chunk
        return jax.tree.unflatten(self.treedef, leaves)

    def slice_tree(self, piece):
        """One device's slice [shard_size] -> a tree of chunks (rank kept: (1, ..., 1, chunk))."""
        leaves, offset = [], 0
        for shape, chunk in zip(self.shapes, self.chunks):
            leaves.append(piece[offset: offset + chunk].reshape((1,) * (len(shape) - 1) + (chunk,)))
            offset += chunk
        return jax.tree.unflatten(self.treedef, leaves)

    def slice_flat(self, tree):
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def make_chunked_layout(params, num_shards: int) -> ChunkedLayout:
    leaves, treedef = jax.tree.flatten(params)
    dtypes = {np.dtype(x.dtype) for x in leaves}
    if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
        raise ValueError(f"zero>0 needs parameters of one floating dtype; got {sorted(map(str, dtypes))}")
    return ChunkedLayout(treedef, tuple(tuple(x.shape) for x in leaves), dtypes.pop(), num_shards)


def check_zero(zero: int, grad_sync: str, grad_compression: str | None) -> None:
    """Raises ValueError for an unknown stage or a combination the ZeRO step does not implement."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not supported; expected one of {list(ZERO_STAGES)} "
                         "(0: replicated, 1: optimizer state sharded, 3: parameters too)")
    if zero == 0:
        return
    if grad_sync not in ZERO_METHODS:
        raise ValueError(f"zero={zero} reduce-scatters gradients with grad_sync 'psum' or 'ring'; "
                         f"grad_sync={grad_sync!r} has no reduce-scatter form here")
    if grad_compression not in (None, "none"):
        raise ValueError(f"zero={zero} does not support grad_compression={grad_compression!r} "
                         "(error feedback is per replicated gradient); use grad_compression='none'")


def opt_state_specs(optimizer: optax.GradientTransformation, layout: ChunkedLayout):
    """Specs of the sliced optimizer state: leaves with a chunk dimension P(data), scalars P()."""
    example = jax.tree.unflatten(layout.treedef, [
        jax.ShapeDtypeStruct((1,) * (len(s) - 1) + (c,), layout.dtype)
        for s, c in zip(layout.shapes, layout.chunks)])
    abstract = jax.eval_shape(optimizer.init, example)
    return jax.tree.map(lambda x: P(AXIS) if x.ndim >= 1 else P(), abstract)


def zero_state_specs(stage: int, opt_specs) -> TrainState:
    return TrainState(step=P(), params=P(AXIS) if stage == 3 else P(), model_state=P(),
                      opt_state=opt_specs, loss_scale=P(), nonfinite_streak=P(), grad_error=None)


def init_zero_state(state: TrainState, optimizer, layout: ChunkedLayout, mesh, stage: int,
                    opt_specs) -> TrainState:
    """Turns a replicated TrainState (params on the mesh) into the sharded one of `stage`."""
    flat = jax.jit(layout.flatten, out_shardings=NamedSharding(mesh, P(AXIS)))(state.params)
    init = jax.shard_map(lambda piece: optimizer.init(layout.slice_tree(piece)), mesh=mesh,
                         in_specs=P(AXIS), out_specs=opt_specs, check_vma=False)
    return state._replace(params=flat if stage == 3 else state.params, opt_state=jax.jit(init)(flat))


def gather_full_params(params, layout: ChunkedLayout, mesh):
    """Stage 3's sharded flat params -> the replicated parameter tree."""
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()),
                              jax.tree.unflatten(layout.treedef, [0] * len(layout.shapes)))
    return jax.jit(layout.unflatten, out_shardings=replicated)(params)


def _global_norm_and_finite(piece):
    square = jnp.sum(jnp.square(piece.astype(jnp.float32)))
    bad = jnp.logical_not(all_finite(piece)).astype(jnp.int32)
    return jnp.sqrt(lax.psum(square, AXIS)), lax.psum(bad, AXIS) == 0


def make_zero_step_body(loss: Callable, optimizer: optax.GradientTransformation,
                        layout: ChunkedLayout, *, stage: int, microbatches: int, num_devices: int,
                        grad_sync: str, clip_norm: float = 0.0) -> Callable:
    """`one_step(state, batch) -> (state, metrics)` of ZeRO `stage` (1 or 3), inside shard_map."""
    method = ZERO_METHODS[grad_sync]

    def one_step(state: TrainState, batch):
        full = gather_params(state.params, layout, AXIS, method) if stage == 3 else state.params

        def scaled_loss(params, micro_batch, model_state):
            value, new_model_state = loss(params, model_state, micro_batch, True)
            return state.loss_scale.scale(value), (value, new_model_state)

        grad_fn = accumulate_gradients(scaled_loss, microbatches, has_aux=True)
        (_, (value, model_state)), grads = grad_fn(full, batch, state.model_state)
        # The one gradient reduction of the optimizer step: a reduce-scatter.
        piece = reduce_scatter_grads(grads, layout, AXIS, method)
        piece = state.loss_scale.unscale(piece / jnp.asarray(num_devices, piece.dtype))
        norm, finite = _global_norm_and_finite(piece)
        if clip_norm:  # optax.clip_by_global_norm's formula, with the whole gradient's norm
            piece = lax.select(norm < clip_norm, piece,
                               (piece / norm.astype(piece.dtype)) * jnp.asarray(clip_norm, piece.dtype))
        own = state.params if stage == 3 else local_slice(layout.flatten(full), layout, AXIS)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            updates, opt_state = optimizer.update(layout.slice_tree(piece), state.opt_state,
                                                  layout.slice_tree(own))
            new_own = layout.slice_flat(optax.apply_updates(layout.slice_tree(own), updates))
        new_own = jnp.where(finite, new_own, own)
        new_params = new_own if stage == 3 else gather_params(new_own, layout, AXIS, method)
        model_state = jax.tree.map(
            lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x, model_state)
        new_state = TrainState(
            step=state.step + 1, params=new_params,
            model_state=select_tree(finite, model_state, state.model_state),
            opt_state=select_tree(finite, opt_state, state.opt_state),
            loss_scale=state.loss_scale.adjust(finite),
            nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1).astype(jnp.int32),
            grad_error=None)
        metrics = {"loss": lax.pmean(value, AXIS), "grad_norm": norm, "finite": finite,
                   "loss_scale": state.loss_scale.loss_scale}
        return new_state, metrics

    return one_step
