"""ZeRO stages 1 and 3 inside the trainer's step (see `jaxopt_train.zero` for the idea).

Both stages are per leaf: each parameter leaf is split along its first
dimension divisible by the device count (`jaxopt_train.zero.leaf_specs`), and
so are its optimizer-state copies (Adam's mu and nu); leaves with no such
dimension stay replicated (their gradient is all-reduced and every device
updates them). Each device reduce-scatters every gradient leaf to its own
shard, one `psum_scatter` per leaf, and updates its shards. A leaf's
reduce-scatter depends only on that leaf's gradient, so XLA issues it while
the backward is still producing the others and overlaps the two; a single flat
reduce-scatter could start only after the whole backward (on 2 H200s,
per-leaf ZeRO-1 lifted gpt-1b data-parallel scaling from 90.8% to ~95% in
`bench train`).

The stages differ only in where the parameters live between steps and so when
they are all-gathered (one all-gather per sharded leaf either way):

- Stage 1: replicated. The updated shards are gathered at the step's end;
  evaluation and checkpoints see the full tree; only the optimizer state is
  1/n per device.
- Stage 3 (FSDP-style): sharded, `TrainState.params` holds this device's
  shards. They are gathered at the step's start, in the compute dtype when
  `grad_dtype="compute"` (cast before the gather: half the gather bytes in
  bf16, and the gradient is then bf16 too); each leaf's gather needs to finish
  only before the forward first reads it, so XLA overlaps the gathers with
  the forward. The eval step gathers the same way; `Trainer.params` gathers a
  replicated copy for export; checkpoints hold the shards as they are.

Global-norm clipping cannot live in the optimizer at stages 1 and 3 (it would
see one shard): the step clips the gradient shards itself with the norm of the
whole gradient (a psum of squared shard norms), with optax's formula.
"""

from __future__ import annotations

import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import mean_term, sum_may_overflow
from jaxopt_train import stochastic_round as sr
from jaxopt_train.precision import all_finite, select_tree
from jaxopt_train.train.state import TrainState, clip_to_norm
from jaxopt_train.train.step import empty_batch, local_gradients, next_scale_and_streak
from jaxopt_train.zero import (elementwise_mismatch, gather_leaves, leaf_specs,
                               opt_state_leaf_specs, place_leaves, reduce_scatter_leaves, spec_dim)

AXIS = "data"
ZERO_STAGES = (0, 1, 3)
# grad_sync -> the all-reduce method of the replicated leaves (jaxopt_train.zero).
ZERO_METHODS = {"psum": "psum", "ring": "ring"}


def check_zero(zero: int, grad_sync: str, grad_compression: str | None) -> None:
    """Raises ValueError for an unknown stage or a combination the ZeRO step does not implement."""
    # An integer, not one equal to a stage: zero=1.0 passed `in` and ran stage 1.
    if isinstance(zero, bool) or not isinstance(zero, numbers.Integral) or zero not in ZERO_STAGES:
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


def zero_state_specs(opt_specs, params_spec=P()) -> TrainState:
    """shard_map specs of a ZeRO TrainState: stage 1 params P(), stage 3 the per-leaf specs."""
    return TrainState(step=P(), params=params_spec, model_state=P(), opt_state=opt_specs,
                      loss_scale=P(), nonfinite_streak=P(), grad_error=None)


def _finish_step(state: TrainState, params, opt_state, model_state, finite, value, norm, empty):
    """The next TrainState and the step's metrics; `params` must already be finite-selected;
    `empty`: the batch had total weight 0 (`train.step.next_scale_and_streak`)."""
    model_state = jax.tree.map(
        lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x, model_state)
    loss_scale, streak = next_scale_and_streak(state, finite, empty)
    new_state = TrainState(
        step=state.step + 1, params=params,
        model_state=select_tree(finite, model_state, state.model_state),
        opt_state=select_tree(finite, opt_state, state.opt_state),
        loss_scale=loss_scale, nonfinite_streak=streak, grad_error=None)
    metrics = {"loss": lax.pmean(value, AXIS), "grad_norm": norm, "finite": finite,
               "loss_scale": state.loss_scale.loss_scale}
    return new_state, metrics


def _update(optimizer: optax.GradientTransformation, grads, opt_state, params, step):
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        seed = sr.step_seed((step, opt_state))  # the same on every shard, as in train.step
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return sr.apply_updates(params, updates, seed), opt_state


# The per-leaf layout ----------------------------------------------------------


def zero_specs(optimizer: optax.GradientTransformation, params, num_devices: int):
    """(param specs, optimizer-state specs): PartitionSpec trees of the per-leaf layout."""
    param_specs = leaf_specs(params, num_devices, AXIS)
    abstract = jax.eval_shape(optimizer.init, params)
    return param_specs, opt_state_leaf_specs(optimizer, abstract, params, param_specs)


def check_elementwise_optimizer(optimizer: optax.GradientTransformation, params, param_specs, *,
                                zero: int, num_devices: int) -> None:
    """Raises ValueError unless updating each device's shards alone equals the replicated update.

    Per-leaf masks (AdamW's weight-decay mask on matrices) pass: shards keep
    their leaf's rank and the tree's structure. Global-norm clipping and
    per-leaf trust ratios (optax.lamb, optax.lars) fail: a device sees only
    its shards' norms. See `jaxopt_train.zero.elementwise_mismatch`.
    """
    mismatch = elementwise_mismatch(optimizer, params, num_devices, param_specs, AXIS)
    if mismatch:
        raise ValueError(
            f"zero={zero} updates each device's shard of the parameters with the optimizer on its "
            "own, so the optimizer must be elementwise (per-parameter math, e.g. optax.adamw, "
            f"optax.sgd); this one is not ({mismatch}). Global-norm clipping "
            "(optax.clip_by_global_norm), trust-ratio optimizers (optax.lamb, optax.lars) and "
            "learning-rate-free ones (optax.contrib.prodigy, dadapt_adamw) see only a shard's "
            "norms or sums. Use zero=0, or the default optimizer (optimizer=None) whose "
            "clip_norm= the ZeRO step applies with the whole gradient's norm")


def init_zero_state(state: TrainState, optimizer, param_specs, opt_specs, mesh, *,
                    zero: int) -> TrainState:
    """`state` (replicated params on the mesh) with the optimizer state built sharded per leaf,
    and at zero=3 the params resharded per leaf too."""
    # jit with out_shardings rather than init inside shard_map on local slices:
    # XLA partitions the init, so each device computes only its shards (Adam's
    # zeros become shard-sized broadcasts; the full state never exists on one
    # device), it needs no slicing code of ours, and it stays right for
    # optimizers whose state is computed from the params rather than zeros.
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), opt_specs)
    state = state._replace(opt_state=jax.jit(optimizer.init, out_shardings=shardings)(state.params))
    if zero == 3:
        state = state._replace(params=place_leaves(state.params, param_specs, mesh))
    return state


def replicated_params(params, mesh):
    """The full parameter tree, replicated on `mesh`, from stage 3's per-leaf shards.

    For export (`Trainer.params`): a device_put, not a fresh `jax.jit` per call,
    which would be traced and compiled each time. Evaluation does not use it: its
    step gathers inside (`zero3_gather`), as the train step does.
    """
    return jax.device_put(params, NamedSharding(mesh, P()))


def own_shards(tree, specs, num_devices: int):
    """Inside shard_map: this device's shard of each replicated leaf (whole if its spec is P())."""
    index = lax.axis_index(AXIS)

    def take(x, spec):
        dim = spec_dim(spec, AXIS)
        if dim is None:
            return x
        size = x.shape[dim] // num_devices
        return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)

    return jax.tree.map(take, tree, specs)


def _leaf_norm_and_finite(grads, specs):
    """Whole-gradient norm and finiteness from every device's shards (sharded leaves psummed,
    replicated leaves, equal on every device, counted once)."""
    leaves, treedef = jax.tree.flatten(grads)
    dims = [spec_dim(spec, AXIS) for spec in treedef.flatten_up_to(specs)]
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves]
    sharded = sum((s for s, dim in zip(squares, dims) if dim is not None), jnp.zeros((), jnp.float32))
    whole = sum((s for s, dim in zip(squares, dims) if dim is None), jnp.zeros((), jnp.float32))
    bad = jnp.logical_not(all_finite(grads)).astype(jnp.int32)
    return jnp.sqrt(lax.psum(sharded, AXIS) + whole), lax.psum(bad, AXIS) == 0


def _update_shards(state: TrainState, grads, own, optimizer, param_specs, *, num_devices: int,
                   method: str, clip_norm: float, weighted: bool = False):
    """Full per-device gradients -> (finite-selected new shards, opt state, finite, norm).

    `weighted`: `grads` are `local_gradients`' weighted shares, whose fp16 leaves come
    divided by the device count already."""
    # fp16 leaves are divided by n before the sum, which can pass 65,504 where the mean
    # does not (`train.step.make_step_body`); the others after it.
    divided = jax.tree.map(lambda g: sum_may_overflow(g.dtype), grads)
    if not weighted:
        grads = jax.tree.map(lambda g: mean_term(g, num_devices, g.dtype), grads)
    # One reduce-scatter per sharded leaf, each free to start once its gradient exists.
    grads = reduce_scatter_leaves(grads, param_specs, AXIS, method=method)
    grads = jax.tree.map(lambda g, p, d: g.astype(p.dtype) if d
                         else g.astype(p.dtype) / jnp.asarray(num_devices, p.dtype),
                         grads, own, divided)
    grads = state.loss_scale.unscale(grads)
    norm, finite = _leaf_norm_and_finite(grads, param_specs)
    if clip_norm:
        grads = clip_to_norm(grads, norm, clip_norm)
    new_own, opt_state = _update(optimizer, grads, state.opt_state, own, state.step)
    return select_tree(finite, new_own, own), opt_state, finite, norm


def zero3_gather(param_specs, grad_cast: Callable | None = None) -> Callable:
    """Inside shard_map: stage 3's per-device shards -> the full params the forward reads.

    With `grad_cast` the shards are cast before they are gathered (half the gather
    bytes in bf16, and no full f32 copy on any device). The train step and the eval
    step both gather this way, so evaluation needs no more memory than a step.
    """
    cast = (lambda tree: tree) if grad_cast is None else grad_cast
    return lambda own: gather_leaves(cast(own), param_specs, AXIS)


def make_zero_step_body(loss: Callable, optimizer: optax.GradientTransformation, param_specs, *,
                        zero: int, microbatches: int, num_devices: int, grad_sync: str,
                        clip_norm: float = 0.0, grad_cast: Callable | None = None,
                        weight_fn: Callable | None = None) -> Callable:
    """`one_step(state, batch) -> (state, metrics)` of per-leaf ZeRO stage `zero`, inside shard_map.

    `state.opt_state` holds this device's shards (`zero_specs`); `state.params`
    are replicated at zero=1 and this device's shards at zero=3. `grad_cast`
    (e.g. `Policy.cast_to_compute`) differentiates with respect to the
    compute-dtype copy of the params, so the reduce-scatters move bf16 (and at
    zero=3 the all-gathers too: the shards are cast before they are gathered);
    each gradient shard is widened to the params' dtype right after its
    reduction. `grad_sync` ("psum" or "ring") is the all-reduce of the
    replicated leaves; sharded leaves always use XLA's reduce-scatter and
    all-gather, which XLA can schedule against the backward and forward.
    `weight_fn`: see `train.step.local_gradients`.
    """
    if zero not in (1, 3):
        raise ValueError(f"{zero=}: the per-leaf ZeRO step implements stages 1 and 3")
    cast = (lambda tree: tree) if grad_cast is None else grad_cast
    gather = zero3_gather(param_specs, grad_cast)
    update = dict(optimizer=optimizer, param_specs=param_specs, num_devices=num_devices,
                  method=ZERO_METHODS[grad_sync], clip_norm=clip_norm,
                  weighted=weight_fn is not None)

    def one_step(state: TrainState, batch):
        if zero == 3:
            own = state.params
            full = gather(own)
        else:
            own = own_shards(state.params, param_specs, num_devices)
            full = cast(state.params)
        value, model_state, grads = local_gradients(loss, state, full, batch, microbatches,
                                                    weight_fn)
        new_own, opt_state, finite, norm = _update_shards(state, grads, own, **update)
        params = new_own if zero == 3 else gather_leaves(new_own, param_specs, AXIS)
        return _finish_step(state, params, opt_state, model_state, finite, value, norm,
                            empty_batch(weight_fn, batch))

    return one_step
