"""`make_zero_step`: the data-parallel step of ZeRO stage 0, 1 or 3 on the flat layout.

What each stage shards and moves is described in the package docstring (`jaxopt_train.zero`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import mean_term, sum_may_overflow
from jaxopt_train.stochastic_round import apply_updates, step_seed, with_step_count
from jaxopt_train.collectives import all_reduce_tree
from jaxopt_train.zero._checks import _check, _mesh_axis_size
from jaxopt_train.zero.elementwise import elementwise_mismatch
from jaxopt_train.zero.layout import (FlatLayout, gather_params, local_slice, make_layout,
                                      opt_state_specs, reduce_scatter_grads)


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
        clipping, trust ratios, a skip of non-finite updates such as
        `optax.apply_if_finite`, which each slice would decide alone;
        `elementwise_mismatch(..., nonfinite=True)` runs it on a small random
        surrogate of `params` to tell). The step applies whatever the
        optimizer returns: it skips no non-finite step itself.
    """
    _check(stage, method)
    if any(getattr(leaf, "dtype", None) == jnp.bfloat16 for leaf in jax.tree.leaves(params)):
        # bf16 params round stochastically with a seed from the state's step count: give
        # optax.sgd, which keeps none, one (a constant seed rounds a repeated update alike).
        optimizer = with_step_count(optimizer)
    n = _mesh_axis_size(mesh, axis_name)
    layout = make_layout(params, n)
    mismatch = elementwise_mismatch(optimizer, params, n, nonfinite=True) if stage else None
    if mismatch:
        raise ValueError(
            f"{stage=} runs the optimizer on each device's 1-D slice of the flattened parameters, "
            "so it must be elementwise with nothing tree-structured: no per-leaf masks or labels "
            "(e.g. AdamW's weight-decay mask, optax.multi_transform), no global-norm clipping, no "
            "per-leaf trust ratios (optax.lamb, optax.lars), no step size summed over the tree "
            "(optax.contrib.prodigy), no skip of a non-finite update (optax.apply_if_finite: each "
            f"slice would skip or apply alone); this optimizer is not ({mismatch}). "
            "Use stage=0, an optimizer without those parts, or the per-leaf layout (the trainer's "
            "zero=1|3), whose shards keep each leaf's rank and the tree's structure and whose step "
            "skips a non-finite step on every device alike")
    slice_specs = opt_state_specs(optimizer, layout, axis_name)
    param_spec = P(axis_name) if stage == 3 else jax.tree.map(lambda _: P(), params)
    opt_spec = jax.tree.map(lambda _: P(), jax.eval_shape(optimizer.init, params)) if stage == 0 else slice_specs
    specs = ZeroState(param_spec, opt_spec)
    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))  # noqa: E731

    def update(grad, opt_state, param):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            seed = step_seed(opt_state)
            updates, opt_state = optimizer.update(grad, opt_state, param)
        # bf16 params round stochastically (jaxopt_train.stochastic_round), shard or whole alike.
        return apply_updates(param, updates, seed), opt_state

    # Means over devices: a float16 term is divided by n before the sum, which can pass
    # 65,504 where the mean does not (bf16 and f32 terms are summed, then divided once).
    term = lambda x: mean_term(x, n, x.dtype)  # noqa: E731
    mean_of_sum = lambda x: x if sum_may_overflow(x.dtype) else x / n  # noqa: E731

    def per_device(state: ZeroState, batch):
        full = gather_params(state.params, layout, axis_name, method) if stage == 3 else state.params
        loss, grads = jax.value_and_grad(loss_fn)(full, batch)
        loss = mean_of_sum(lax.psum(term(loss), axis_name))
        grads = jax.tree.map(term, grads)
        if stage == 0:
            grads = all_reduce_tree(grads, axis_name, method=method)
            grads = jax.tree.map(mean_of_sum, grads)
            return ZeroState(*update(grads, state.opt_state, full)), loss
        grad_slice = mean_of_sum(reduce_scatter_grads(grads, layout, axis_name, method))
        own = state.params if stage == 3 else local_slice(layout.flatten(full), layout, axis_name)
        new_slice, opt_state = update(grad_slice, state.opt_state, own)
        new_params = new_slice if stage == 3 else gather_params(new_slice, layout, axis_name, method)
        return ZeroState(new_params, opt_state), loss

    step = smap(per_device, (specs, P(axis_name)), (specs, P()))

    def init(params) -> ZeroState:
        layout.check(params)
        if stage == 0:
            replicated = jax.device_put(params, NamedSharding(mesh, P()))
            # out_shardings: Adam's zeros_like moments read no input data, so a bare jit
            # compiles for one device, which outputs typed on an Explicit-axes mesh
            # (jax.make_mesh's default) refuse.
            init_state = jax.jit(optimizer.init, out_shardings=NamedSharding(mesh, P()))
            return ZeroState(replicated, init_state(replicated))
        flat = jax.device_put(layout.flatten(params), NamedSharding(mesh, P(axis_name)))
        opt_state = smap(optimizer.init, P(axis_name), slice_specs)(flat)
        kept = flat if stage == 3 else jax.device_put(params, NamedSharding(mesh, P()))
        return ZeroState(kept, opt_state)

    return ZeroStep(init=init, step=step, layout=layout, state_specs=specs)
