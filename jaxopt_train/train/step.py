"""The data-parallel train and eval steps.

One optimizer step, per device inside `jax.shard_map` over the mesh axis
"data": accumulate gradients over micro-batches (`lax.scan`), reduce them
across devices ONCE (`all_reduce_tree`), average, unscale with the loss
scale, check they are finite, clip and update with optax, and keep params,
optimizer state and model state unchanged when they are not finite.

Params and optimizer state are replicated (`P()`); batches are split along
the batch axis. `steps_per_dispatch=k` scans k such steps over k pre-staged
batches inside one compiled call, so the host dispatches once per k steps.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.accumulation import (accumulate_gradients, batch_weight, mean_term,
                                       sum_may_overflow, weighted_share)
from jaxopt_train.collectives import all_reduce_tree, init_error_feedback
from jaxopt_train import stochastic_round as sr
from jaxopt_train.precision import NoOpLossScale, all_finite, select_tree
# device_pool_limit is a name of this module too: smallest_pool looks it up here, where
# tests replace it, and bench/train_remat imports it from here.
from jaxopt_train.runtime.memory import device_pool_limit, format_bytes
from jaxopt_train.train.state import TrainState, global_norm_f32

AXIS = "data"


def make_data_mesh(devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh named "data" over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; need at least one device for the data mesh")
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def _pmean_floating(tree):
    return jax.tree.map(
        lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def combine_counts(new, old, microbatches: int):
    """The model state's integer leaves (call counters, RNG counts) after K micro-batches.

    Each micro-batch starts from `old`, and the accumulation sums integer leaves, so
    `new` holds sum_k(new_k): the step's value is old + sum_k(new_k - old), i.e.
    new - (K - 1) * old (modular, as the counters are). Floating leaves (BatchNorm
    statistics) keep the micro-batches' mean.
    """
    if microbatches == 1:
        return new
    return jax.tree.map(
        lambda n, o: n - (microbatches - 1) * o if jnp.issubdtype(n.dtype, jnp.integer) else n,
        new, old)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _salt_rng_streams(model_state, salt: jax.Array):
    """`model_state` with every typed PRNG key (an `nnx.Rngs` stream's key) folded with
    bits of the typed key `salt`."""
    bits = jax.random.bits(salt, dtype=jnp.uint32)

    def one(x):
        if not _is_key(x):
            return x
        fold = lambda key: jax.random.fold_in(key, bits)  # noqa: E731
        for _ in range(x.ndim):  # a key per layer where nnx.vmap stacked the layers
            fold = jax.vmap(fold)
        return fold(x)
    return jax.tree.map(one, model_state)


def local_gradients(loss: Callable, state: TrainState, params, batch, microbatches: int,
                    weight_fn: Callable | None = None):
    """(mean loss, new model state, loss-scaled gradients w.r.t. `params`) of this
    device's batch, accumulated over `microbatches` with `lax.scan`; call inside
    shard_map over "data".

    With `weight_fn` (`ModelFns.weight`) micro-batches count by their weight, and
    loss and gradients come back as `accumulation.weighted_share`s: their plain mean
    over devices (the step's pmean, or its sum / n) is the weighted mean; for fp16
    gradients, whose sum may overflow, their plain sum (`narrow_as_sum`).

    RNG streams in the model state (Dropout's) draw a different mask on every
    device and every micro-batch: for each call their keys are folded with a salt
    made of the device's index along "data" (split once more per micro-batch by
    `accumulate_gradients`), and the carried state keeps the unsalted keys, whose
    counts advance once per step. Without it every replica and micro-batch of a
    step would drop the same units of its own examples, i.e. fewer independent
    masks than examples. Models without RNG streams compile as before.
    """
    salted = any(_is_key(x) for x in jax.tree.leaves(state.model_state))
    # A micro-batch's loss is a mean over 1/K of the examples, so the per-example
    # cotangents of its fp16 backward were K times the whole batch's: microbatches=2
    # overflowed (and skipped a step) where microbatches=1 did not. As PyTorch's
    # `loss / accumulation_steps`, the loss-scaled loss is divided by K and the
    # gradients multiplied back. Only under a loss scale: fp32/bf16 keep their bits.
    split = 1 if isinstance(state.loss_scale, NoOpLossScale) else microbatches

    def scaled_loss(params, micro_batch, model_state, *salt):
        call_state = _salt_rng_streams(model_state, salt[0]) if salt else model_state
        value, new_model_state = loss(params, call_state, micro_batch, True)
        # The salted keys are this call's only: carry the stream's own key.
        new_model_state = jax.tree.map(lambda new, old: old if _is_key(old) else new,
                                       new_model_state, model_state)
        scaled = state.loss_scale.scale(value)
        return (scaled if split == 1 else scaled / split), (value, new_model_state)

    extra = ()
    if salted:
        extra = (jax.random.fold_in(jax.random.key(0), lax.axis_index(AXIS)),)
    grad_fn = accumulate_gradients(scaled_loss, microbatches, has_aux=True, weight_fn=weight_fn)
    (scaled, (value, model_state)), grads = grad_fn(params, batch, state.model_state, *extra)
    if split > 1:  # powers of 2 are exact; an fp16 gradient is where it was before the division
        scaled, grads = jax.tree.map(lambda x: x * jnp.asarray(split, x.dtype)
                                     if jnp.issubdtype(x.dtype, jnp.inexact) else x, (scaled, grads))
    if weight_fn is not None:
        # The aux `value` is a plain mean over the micro-batches; the loss output is weighted.
        value = state.loss_scale.unscale(scaled)
        weight = batch_weight(weight_fn, batch)
        value = weighted_share(value, weight, AXIS)  # pmean'd for the metrics, whatever its dtype
        # fp16 gradients as shares whose sum is the weighted mean: scaled by n first, as the
        # others are, a device holding most of the weight could pass 65,504.
        grads = weighted_share(grads, weight, AXIS, narrow_as_sum=True)
    return value, combine_counts(model_state, state.model_state, microbatches), grads


def empty_batch(weight_fn: Callable | None, batch) -> jax.Array:
    """Whether the step's batch has total weight 0 over "data" (nothing in it counts);
    always False without `weight_fn`. Call inside shard_map."""
    if weight_fn is None:
        return jnp.zeros((), jnp.bool_)
    return lax.psum(batch_weight(weight_fn, batch), AXIS) == 0


def next_scale_and_streak(state: TrainState, finite, empty) -> tuple[Any, jax.Array]:
    """The loss scale and non-finite streak after a step.

    A batch of total weight 0 has NaN gradients, as its mean over nothing would: the
    step is skipped like an overflow, but it says nothing about the scale. A dynamic
    scale would back off for it, and a run of padding-only batches would hit
    `max_nonfinite_steps`; so the scale and the streak are kept, and only
    `skipped_steps` counts it (the logged lr counts skips)."""
    scale = select_tree(empty, state.loss_scale.skip(), state.loss_scale.adjust(finite))
    streak = jnp.where(empty, state.nonfinite_streak,
                       jnp.where(finite, 0, state.nonfinite_streak + 1)).astype(jnp.int32)
    return scale, streak


def make_step_body(loss: Callable, optimizer: optax.GradientTransformation, *,
                   microbatches: int, num_devices: int, grad_sync: str = "psum",
                   grad_compression: str | None = None,
                   grad_cast: Callable | None = None,
                   weight_fn: Callable | None = None) -> Callable:
    """Returns `one_step(state, batch) -> (state, metrics)` for use inside shard_map.

    `loss(params, model_state, batch, train)` is a `ModelFns.loss`. With
    compression and `state.grad_error` set, the reduction's error feedback is
    read from and written back to `state.grad_error` (this device's slice).

    `grad_cast` (e.g. `Policy.cast_to_compute`) differentiates with respect to
    `grad_cast(params)` instead of the stored params: with bf16 compute and f32
    master weights the gradients then stay bf16 (they carry no more than bf16
    information anyway: every matmul that makes them runs in bf16), which
    halves their memory, the optimizer's read of them and the bytes of the
    cross-device reduction. They are widened to the params' dtype right after
    the reduction, before averaging, unscaling and the optimizer.

    `weight_fn`: see `local_gradients`.
    """
    sync_kwargs: dict[str, Any] = {}
    if grad_compression not in (None, "none"):
        sync_kwargs["compression"] = grad_compression

    def reduce_grads(grads, grad_error):
        if grad_error is None or "compression" not in sync_kwargs:
            return all_reduce_tree(grads, AXIS, method=grad_sync, **sync_kwargs), grad_error
        return all_reduce_tree(grads, AXIS, method=grad_sync, error_state=grad_error, **sync_kwargs)

    def one_step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        params = state.params if grad_cast is None else grad_cast(state.params)
        value, model_state, grads = local_gradients(loss, state, params, batch, microbatches,
                                                    weight_fn)
        empty = empty_batch(weight_fn, batch)
        # The one cross-device reduction of this optimizer step. (Error feedback
        # holds loss-scaled units: a changed fp16 scale mis-weights one step's
        # correction by the same factor, a bounded and transient error.)
        # fp16 leaves are divided by n before the sum (as PyTorch DDP's hook does): a sum of
        # n loss-scaled fp16 gradients passes 65,504 where their mean does not. bf16 and f32
        # are summed as they are and divided once, after.
        divided = jax.tree.map(lambda g: sum_may_overflow(g.dtype), grads)
        if weight_fn is None:  # weighted fp16 shares come divided (`local_gradients`)
            grads = jax.tree.map(lambda g: mean_term(g, num_devices, g.dtype), grads)
        grads, grad_error = reduce_grads(grads, state.grad_error)
        if grad_cast is not None:  # widen before averaging/unscaling: no fp16 underflow
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        grads = state.loss_scale.unscale(
            jax.tree.map(lambda g, d: g if d else g / num_devices, grads, divided))
        finite = all_finite(grads)
        # optax mixes Python floats with int32 counts (Adam's b1**count), which
        # strict promotion (our tests' setting) rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        # bf16 params (no f32 master copy) round stochastically (see stochastic_round). The
        # train step joins the seed: under an optimizer with no step count (plain SGD) the
        # bits would otherwise repeat for a weight that meets the same update again.
        params = sr.apply_updates(state.params, updates, sr.step_seed((state.step, state.opt_state)))
        model_state = _pmean_floating(model_state)
        loss_scale, streak = next_scale_and_streak(state, finite, empty)
        new_state = TrainState(
            step=state.step + 1,
            params=select_tree(finite, params, state.params),
            model_state=select_tree(finite, model_state, state.model_state),
            opt_state=select_tree(finite, opt_state, state.opt_state),
            loss_scale=loss_scale, nonfinite_streak=streak,
            # A non-finite step must not poison the carried error forever.
            grad_error=(None if grad_error is None
                        else select_tree(finite, grad_error, state.grad_error)))
        metrics = {"loss": lax.pmean(value, AXIS), "grad_norm": global_norm_f32(grads),
                   "finite": finite, "loss_scale": state.loss_scale.loss_scale}
        return new_state, metrics

    return one_step


def state_specs(error_feedback: bool) -> TrainState:
    """shard_map specs of a TrainState: all replicated but the per-device error feedback."""
    return TrainState(step=P(), params=P(), model_state=P(), opt_state=P(), loss_scale=P(),
                      nonfinite_streak=P(), grad_error=P(AXIS) if error_feedback else None)


def init_sharded_error_feedback(params, mesh: jax.sharding.Mesh):
    """Zero error feedback for `params`: one f32 slice per device, sharded over "data"."""
    num_devices = mesh.shape[AXIS]
    make = jax.jit(lambda p: init_error_feedback(p, num_devices),
                   out_shardings=NamedSharding(mesh, P(AXIS)))
    return make(params)


def build_train_step(loss: Callable, optimizer: optax.GradientTransformation,
                     mesh: jax.sharding.Mesh, *, microbatches: int = 1, grad_sync: str = "psum",
                     grad_compression: str | None = None, steps_per_dispatch: int = 1,
                     error_feedback: bool = False, grad_cast: Callable | None = None,
                     weight_fn: Callable | None = None) -> Callable:
    """A jitted `step(state, batches) -> (state, metrics)` with the state donated.

    `batches` leaves have shape [steps_per_dispatch, global_batch, ...], sharded
    `P(None, "data")`; metrics leaves have shape [steps_per_dispatch].
    `error_feedback=True` means `state.grad_error` is set (see `state_specs`);
    `grad_cast`, `weight_fn`: see `make_step_body`.
    """
    num_devices = mesh.shape[AXIS]
    one_step = make_step_body(loss, optimizer, microbatches=microbatches, num_devices=num_devices,
                              grad_sync=grad_sync, grad_compression=grad_compression,
                              grad_cast=grad_cast, weight_fn=weight_fn)
    return jit_steps(one_step, state_specs(error_feedback), mesh, steps_per_dispatch)


def jit_steps(one_step: Callable, specs: TrainState, mesh: jax.sharding.Mesh,
              steps_per_dispatch: int) -> Callable:
    """`one_step` under shard_map, `steps_per_dispatch` of them per call, jitted with the state donated."""
    def per_device(state, batches):
        if steps_per_dispatch == 1:
            state, metrics = one_step(state, jax.tree.map(lambda x: x[0], batches))
            return state, jax.tree.map(lambda m: m[None], metrics)
        return lax.scan(one_step, state, batches)

    # check_vma=False: ring reductions built from ppermute return values that
    # are equal on every device but typed as varying; P() outputs are correct.
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(None, AXIS)),
                            out_specs=(specs, P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def build_eval_step(loss: Callable, mesh: jax.sharding.Mesh, *, params_spec=P(),
                    gather: Callable | None = None, weight_fn: Callable | None = None) -> Callable:
    """A jitted `eval_step(params, model_state, batch) -> (mean loss, weight)` (batch leaves
    [global_batch, ...]).

    `params_spec` and `gather`: params held sharded (ZeRO stage 3: the per-leaf specs, and
    the function that gathers them inside the step); by default they are replicated.
    `weight_fn`: devices count by their batch's weight (see `local_gradients`). `weight` is
    what the mean is over, summed over the devices: the total of `weight_fn`, or else the
    number of examples; the caller combines several batches' means with it.
    """
    def per_device(params, model_state, batch):
        if gather is not None:
            params = gather(params)
        value, _ = loss(params, model_state, batch, False)
        if weight_fn is not None:
            weight = batch_weight(weight_fn, batch)
            value = weighted_share(value, weight, AXIS)
        else:
            weight = jnp.float32(jax.tree.leaves(batch)[0].shape[0])
        return lax.pmean(value, AXIS), lax.psum(weight, AXIS)

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(params_spec, P(), P(AXIS)),
                            out_specs=(P(), P()), check_vma=False)
    return jax.jit(sharded)


def replicate(tree, mesh: jax.sharding.Mesh):
    """Puts every leaf of `tree` on all devices of `mesh` (replicated).

    The result may share the leaves' buffers (device_put does on a leaf's own
    device, even with may_alias=False, jax 0.10), so a train step that donates it
    deletes them too: pass copies of arrays anyone will read again.
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _global_array(np.asarray(x) if not isinstance(x, jax.Array)
                                                 else x, sharding), tree)


def _global_array(x, sharding):
    if isinstance(x, jax.Array) and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        # A typed key (nnx.Dropout's stream) has no numpy form: its raw uint32 words go
        # across and are wrapped again with the same implementation.
        data = jax.make_array_from_process_local_data(sharding, np.asarray(jax.random.key_data(x)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def place_batch(batch, mesh: jax.sharding.Mesh, spec: P):
    """Shards a host batch (the same global numpy batch on every process) over `mesh`.

    Each process hands over only the blocks its own devices hold, whatever rows those
    are: a mesh whose devices interleave processes gives a process rows that are not
    one contiguous range.
    """
    sharding = NamedSharding(mesh, spec)

    def one(x):
        x = np.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, batch)


def memory_summary(compiled) -> str:
    """One line from `compiled.memory_analysis()` (sizes per device), or why it is missing."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError) as err:  # not every backend implements it
        return f"memory analysis unavailable: {err}"
    if stats is None:
        return "memory analysis unavailable on this backend"
    fields = (("arguments", "argument_size_in_bytes"), ("outputs", "output_size_in_bytes"),
              ("temporaries", "temp_size_in_bytes"), ("aliased", "alias_size_in_bytes"),
              ("code", "generated_code_size_in_bytes"))
    parts = [f"{name} {format_bytes(getattr(stats, attr, 0))}" for name, attr in fields]
    total = (getattr(stats, "argument_size_in_bytes", 0) + getattr(stats, "output_size_in_bytes", 0)
             + getattr(stats, "temp_size_in_bytes", 0) - getattr(stats, "alias_size_in_bytes", 0))
    return f"compiled step memory per device: {', '.join(parts)}; total ~{format_bytes(total)}"


def smallest_pool(devices) -> int | None:
    """The smallest memory pool (`device_pool_limit`) of this process's devices among
    `devices`, and with several processes the smallest of every process's, so that all
    decide alike (a check that refused on one host only would leave the others waiting in
    the step's collectives); None where no device reports one."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    pools = [limit for limit in map(device_pool_limit, local) if limit is not None]
    mine = min(pools) if pools else -1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        every = np.asarray(multihost_utils.process_allgather(np.int64(mine))).ravel()
        known = every[every >= 0]
        return int(known.min()) if known.size else None
    return mine if mine >= 0 else None


def agreed_needed_bytes(needed: int | None) -> int | None:
    """The most bytes any process's compile of a step needs (`needed`: this one's), None
    if any process has no memory analysis.

    Each process compiles the step itself, and on GPUs the analyses may differ
    (autotuned workspaces): deciding on its own figure, one host could run a step (or
    keep a remat candidate) that another refuses, and the others would then wait in
    collectives that never meet.
    """
    if jax.process_count() == 1:
        return needed
    from jax.experimental import multihost_utils  # noqa: PLC0415

    every = np.asarray(multihost_utils.process_allgather(
        np.int64(-1 if needed is None else needed))).ravel()
    return None if (every < 0).any() else int(every.max())
