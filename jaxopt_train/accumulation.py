"""Micro-batch gradient accumulation.

Two ways to train with a batch larger than memory allows:

- `accumulate_gradients(loss_fn, K)`: one compiled step splits the batch into
  K micro-batches and sums their gradients with `lax.scan` (f32 accumulators).
  Under data parallelism, reduce the returned gradients across devices once,
  after the scan (e.g. `lax.psum` inside `jax.shard_map`), never per
  micro-batch: inside shard_map the gradients stay per-device (the params are
  marked varying over the batch's mesh axes), and `tests/test_accumulation.py`
  checks the compiled HLO for a single all-reduce.
- `multi_steps(optimizer, K)`: `optax.MultiSteps` for micro-batches fed from
  the host one jit call at a time; the inner optimizer only steps every K calls.

Both follow `jaxopt_train.precision`'s conventions: gradients are of the
(possibly scaled) loss w.r.t. f32 master weights; unscale before the optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxopt_train._checks import is_int
from jaxopt_train._typed_sharding import to_varying, varying_axes, varying_axes_of_tree
from jaxopt_train.precision import as_float_dtype

AUX_COMBINE = ("mean", "sum", "stack")


def check_divisible(global_batch: int, num_microbatches: int, num_devices: int = 1) -> int:
    """Returns the per-device micro-batch size, or raises ValueError naming the numbers.

    Each of `num_microbatches` micro-batches must split evenly over `num_devices`.
    """
    for name, value in (("global_batch", global_batch), ("num_microbatches", num_microbatches),
                        ("num_devices", num_devices)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if global_batch % num_microbatches:
        raise ValueError(f"{global_batch=} is not divisible by {num_microbatches=}; pick a batch "
                         "size that is a multiple of the number of micro-batches")
    micro = global_batch // num_microbatches
    if micro % num_devices:
        raise ValueError(f"micro-batch size {micro} ({global_batch=} / {num_microbatches=}) is not "
                         f"divisible by {num_devices=}; use a global batch that is a multiple of "
                         f"{num_microbatches * num_devices}")
    return micro // num_devices


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and x.shape == ()


def _looks_like_raw_key(x) -> bool:
    """uint32[2]: what `jax.random.PRNGKey` returns, but also any pair of uint32 data."""
    return getattr(x, "dtype", None) == np.dtype(np.uint32) and np.shape(x) == (2,)


def _warn_raw_keys(extra) -> None:
    # A raw uint32[2] key cannot be told from uint32[2] data, so it is neither
    # split (that would scramble data) nor refused (that would break data);
    # but passed unchanged it gives every micro-batch the same dropout mask,
    # a silent statistical error, so say so once, at trace time.
    positions = [i for i, x in enumerate(extra) if _looks_like_raw_key(x)]
    if positions:
        warnings.warn(
            f"extra argument(s) at position(s) {positions} are uint32[2], the layout of a legacy "
            "jax.random.PRNGKey: they reach every micro-batch unchanged (the same random numbers "
            "each time). If they are keys, pass a typed key (jax.random.key(seed), or "
            "jax.random.wrap_key_data(raw_key)) and it is split per micro-batch.",
            UserWarning, stacklevel=3)


def _batch_size(batch) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves to split into micro-batches")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        shapes = [np.shape(x) for x in leaves]
        raise ValueError(f"every batch leaf needs the same leading batch axis; got shapes {shapes}")
    return sizes.pop()


def _split_microbatches(batch, num_microbatches: int):
    # Micro-batch k takes rows k, k+K, k+2K, ... : reshaping (B, ...) to
    # (B/K, K, ...) keeps a batch sharded in blocks along its leading axis
    # local to each device, so the split needs no communication.
    def split(x):
        x = jnp.reshape(x, (x.shape[0] // num_microbatches, num_microbatches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
    return jax.tree.map(split, batch)


def sum_may_overflow(dtype) -> bool:
    """True for float16 (and narrower): a sum of n means can overflow where their mean does not.

    bfloat16 has float32's exponent range, so bf16 and f32 sums are safe: they add the
    terms as they are and divide once, at the end (one rounding fewer). False for
    non-float dtypes.
    """
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def _at_least(dtype, accum_dtype) -> np.dtype:
    """The dtype a mean of `dtype` values runs in: `accum_dtype`, or `dtype` where that is wider
    (float32 for float16 against bfloat16). A narrow accumulator is for the gradients' memory;
    cast to float16, a loss-scaled float32 loss (3 * 2**15) was inf."""
    dtype, accum_dtype = np.dtype(dtype), np.dtype(accum_dtype)
    bits, accum_bits = jnp.finfo(dtype).bits, jnp.finfo(accum_dtype).bits
    if bits == accum_bits and dtype != accum_dtype:
        return np.dtype(np.float32)
    return dtype if bits > accum_bits else accum_dtype


def grad_accum_dtype(dtype, accum_dtype) -> np.dtype:
    """What a gradient of `dtype` is summed in over micro-batches: `accum_dtype` (a narrow one
    is for the gradients' memory, as asked), but a gradient wider than both it and float32
    (float64) keeps its dtype, and a complex one stays complex with parts at least as wide
    as `accum_dtype`: cast to a real accumulator it lost its imaginary part."""
    dtype, accum_dtype = np.dtype(dtype), np.dtype(accum_dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _complex_with(_wide_real(dtype, accum_dtype))
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > max(accum_dtype.itemsize, 4):
        return dtype
    return accum_dtype


def _wide_real(*dtypes) -> np.dtype:
    """float64 if one of `dtypes` (floating or complex) has 64-bit parts, else float32. (Picked
    by width: the tests' strict promotion has no float32 + bfloat16 rule.)"""
    return np.dtype(np.float64 if any(jnp.finfo(d).bits == 64 for d in dtypes) else np.float32)


def _complex_with(real) -> np.dtype:
    return np.dtype(np.complex128 if np.dtype(real) == np.float64 else np.complex64)


def mean_term(x, n: int, dtype):
    """`x` as one of n terms of a mean in `dtype`: `x / n` (in f32) where `dtype`'s sum may
    overflow, else `x` itself, to be divided by n after the sum."""
    if sum_may_overflow(dtype):
        return (x.astype(jnp.float32) / n).astype(dtype)
    return x.astype(dtype)


def _zeros_like(x, dtype):
    # Inside shard_map a gradient carries its param's varying axes; the scan
    # carry must start with the same ones.
    zeros = jnp.zeros(jnp.shape(x), dtype)
    vma = tuple(sorted(varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros


def _combine_aux(aux, how: str, accum_dtype):
    """Combines aux leaves stacked along a leading micro-batch axis, as `aux_combine` documents."""
    if how == "stack":
        return aux

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x[-1]  # a PRNG key (a model's RNG stream) has no sum or mean: the last one
        if x.dtype == np.dtype(np.bool_):
            # A boolean in bool dtype sums to "any"; under "mean" a predicate over
            # the batch (jnp.all(...), all_finite) holds for the full batch only if
            # it holds for every micro-batch.
            return jnp.all(x, axis=0) if how == "mean" else jnp.any(x, axis=0)
        if how == "sum" or not jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.sum(x, axis=0, dtype=x.dtype)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            # Averaged like a real float (it was summed: K times the full batch's mean), in
            # complex: a real accumulator would drop the imaginary part.
            wide = _complex_with(_wide_real(x.dtype, accum_dtype))
            return jnp.mean(x.astype(wide), axis=0).astype(x.dtype)
        return jnp.mean(x.astype(_at_least(x.dtype, accum_dtype)), axis=0).astype(x.dtype)
    return jax.tree.map(one, aux)


def check_weight_fn(weight_fn) -> None:
    """Raises TypeError unless `weight_fn` is None or callable (see `accumulate_gradients`)."""
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(f"weight_fn={weight_fn!r} is not callable; expected weight_fn(batch) -> "
                        "a scalar weight >= 0 (e.g. lambda batch: batch['mask'].sum())")


def batch_weight(weight_fn: Callable[[Any], Any], batch) -> jax.Array:
    """`weight_fn(batch)` checked to be a real scalar (see `accumulate_gradients`), in f32;
    a negative weight (traced, so it cannot raise) becomes NaN, so the loss and gradients it
    enters are NaN and the trainer skips the step: a micro-batch of weight -w added nothing
    while the total counted -w, and the rest were silently scaled up."""
    weight = weight_fn(batch)
    shape = np.shape(weight)
    dtype = weight.dtype if hasattr(weight, "dtype") else np.asarray(weight).dtype
    if shape != () or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
                           or dtype == np.dtype(np.bool_)):
        raise ValueError(f"weight_fn(batch) must return a real scalar (e.g. the number of tokens "
                         f"that count); it returned shape={shape} dtype={dtype}")
    weight = jnp.asarray(weight).astype(jnp.float32)
    return jnp.where(weight >= 0, weight, jnp.nan)


def accumulate_gradients(loss_fn: Callable[..., Any], num_microbatches: int, *,
                         accum_dtype=jnp.float32, has_aux: bool = False,
                         aux_combine: str = "mean",
                         weight_fn: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """Wraps `jax.value_and_grad(loss_fn, has_aux=...)` to run over micro-batches.

    Args:
      loss_fn: `loss_fn(params, batch, *extra) -> loss` (or `(loss, aux)` with
        `has_aux`), where `loss` is a scalar mean over the batch.
      num_microbatches: K; the batch's leading axis B must be divisible by K.
        Micro-batch k holds rows `k::K` of every batch leaf (shard-friendly).
      accum_dtype: dtype of the gradient and loss accumulators (f32 keeps
        bf16 gradients from losing low bits over K additions); a loss or aux
        value of a wider dtype is averaged in its own. With a float16
        accumulator each gradient is divided by K before it is added.
      has_aux: as in `jax.value_and_grad`.
      aux_combine: how per-micro-batch aux values combine: "mean" (default:
        floating and complex leaves are averaged, so per-batch means match the
        full batch; integer leaves, e.g. counts, are summed; boolean leaves are and-ed,
        so a predicate over the batch such as `jnp.all(...)` matches the full
        batch), "sum" (every leaf summed; booleans or-ed) or "stack" (leaves
        get a leading axis of size K, also when K is 1). Stack a flag that
        says whether something happened anywhere (`jnp.any(...)`) and reduce
        it yourself.
      weight_fn: `weight_fn(batch) -> scalar >= 0`, what the loss is a mean over,
        summed over the batch's examples (e.g. `batch["mask"].sum()`, the tokens
        that count). `loss_fn` stays a mean over that weight on its micro-batch;
        micro-batch k then counts in proportion to its weight w_k (loss and
        gradients are sum_k w_k * x_k / sum_k w_k), which is the full batch's
        weighted mean when micro-batches hold different numbers of tokens
        (without it each micro-batch counts equally: a mean of means). A
        micro-batch of weight 0 adds nothing, even where its mean is NaN; a
        batch of total weight 0 gives NaN loss and gradients, as its full-batch
        mean would, and so does a negative weight. Aux values are combined as
        `aux_combine` says, unweighted.

    Returns:
      `grad_fn(params, batch, *extra)` returning `(loss, grads)` or
      `((loss, aux), grads)`: the mean loss and mean gradients over the K
      micro-batches (equal to the full-batch ones when `loss_fn` is a mean over
      examples), grads in the dtype of `params`. Any scalar typed PRNG key in
      `extra` (`jax.random.key`) is split into K keys, micro-batch k getting
      `jax.random.split(key, K)[k]`; other `extra` arguments reach every
      micro-batch unchanged. That includes a legacy raw key
      (`jax.random.PRNGKey`, uint32[2]), which cannot be told from uint32
      data: with K > 1 it draws a UserWarning at trace time; pass
      `jax.random.key(seed)` or `jax.random.wrap_key_data(raw_key)` instead.

    Inside `jax.shard_map` the gradients are this device's own: params that do
    not vary over the mesh axes the batch (or `extra`) varies over are marked
    varying first, so JAX's varying-axes checking (`check_vma=True`) does not
    psum them in the backward pass of every micro-batch. Reduce them once,
    after the call (`lax.psum`, `all_reduce_tree`), or use
    `data_parallel_value_and_grad`.
    """
    if not is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} must be a positive int")
    if aux_combine not in AUX_COMBINE:
        raise ValueError(f"{aux_combine=}; expected one of {AUX_COMBINE}")
    accum_dtype = as_float_dtype(accum_dtype, "accum_dtype")  # "f32", "bf16" or a dtype
    check_weight_fn(weight_fn)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)
    num_microbatches = int(num_microbatches)

    def grad_fn(params, batch, *extra):
        batch_size = _batch_size(batch)
        if batch_size == 0:  # the mean over no examples: a NaN loss and zero gradients
            raise ValueError("the batch is empty (leading axis 0); expected at least "
                             f"{num_microbatches=} examples")
        if batch_size % num_microbatches:
            raise ValueError(f"batch size {batch_size} is not divisible by {num_microbatches=}; "
                             "pick a batch size that is a multiple of the number of micro-batches")
        # Inside shard_map (check_vma=True) keep each device's gradients local
        # until the caller's one reduction after the scan; a no-op elsewhere.
        # (Under shard_map's varying-axes checking, differentiating replicated params
        # against per-device data puts a psum in the backward of every micro-batch, inside
        # the scan: one all-reduce each, and a caller who then reduces once more gets n
        # times the gradient. Varying params keep the gradients local until that psum.)
        params = to_varying(params, varying_axes_of_tree((batch, extra)))
        if num_microbatches == 1:
            out, grads = value_and_grad(params, batch, *extra)
            if weight_fn is not None:  # the same checks as with K > 1, and NaN at weight 0
                weight = batch_weight(weight_fn, batch)
                loss, aux = out if has_aux else (out, None)
                loss, grads = jax.tree.map(lambda x: jnp.where(weight > 0, x, jnp.nan).astype(x.dtype),
                                           (loss, grads))
                out = (loss, aux) if has_aux else loss
            if has_aux and aux_combine == "stack":  # as documented: a leading axis of size K
                loss, aux = out
                out = loss, jax.tree.map(lambda x: jnp.expand_dims(jnp.asarray(x), 0), aux)
            return out, grads  # the mean or sum of one micro-batch is itself
        _warn_raw_keys(extra)
        key_positions = [i for i, x in enumerate(extra) if _is_key(x)]
        keys = [jax.random.split(extra[i], num_microbatches) for i in key_positions]
        micro = _split_microbatches(batch, num_microbatches)

        shares = total = None  # without weight_fn: a plain mean over the K micro-batches
        # float32, or float64 where the accumulator or a gradient is (a float32 share put a
        # 3e-8 error on float64 gradients).
        share_dtype = _wide_real(accum_dtype, *[
            jnp.result_type(p) for p in jax.tree.leaves(params)
            if jnp.issubdtype(jnp.result_type(p), jnp.inexact)])
        if weight_fn is not None:
            # Each micro-batch's share w_k / sum(w), before the scan: the accumulator
            # then holds a gradient's magnitude, not one times a token count (an f16
            # accumulator overflowed past 65,504 tokens).
            weights = jax.vmap(lambda mb: batch_weight(weight_fn, mb))(micro).astype(share_dtype)
            total = jnp.sum(weights)
            shares = weights / total

        def weighted_term(g, share, dtype):
            # A share of 0 adds nothing (not NaN * 0 from a mean over no tokens).
            work = _wide_real(dtype, share_dtype)
            work = _complex_with(work) if jnp.issubdtype(dtype, jnp.complexfloating) else work
            return jnp.where(share > 0, g.astype(work) * share.astype(work), 0).astype(dtype)

        def body(grad_sum, xs):
            micro_batch, micro_keys, share = xs
            args = list(extra)
            for i, key in zip(key_positions, micro_keys):
                args[i] = key
            out, grads = value_and_grad(params, micro_batch, *args)
            loss, aux = out if has_aux else (out, None)
            if weight_fn is None:
                terms = jax.tree.map(lambda g, s: mean_term(g, num_microbatches, s.dtype),
                                     grads, grad_sum)
            else:
                terms = jax.tree.map(lambda g, s: weighted_term(g, share, s.dtype), grads, grad_sum)
            grad_sum = jax.tree.map(lambda s, g: s + g, grad_sum, terms)
            return grad_sum, (loss, aux)

        zeros = jax.tree.map(
            lambda p: _zeros_like(p, grad_accum_dtype(jnp.result_type(p), accum_dtype)), params)
        grad_sum, (losses, aux) = lax.scan(body, zeros, (micro, keys, shares))
        # A gradient has its primal's dtype: cast the f32 means back to it.
        if weight_fn is None:
            loss = jnp.mean(losses.astype(_at_least(losses.dtype, accum_dtype))).astype(losses.dtype)
            grads = jax.tree.map(  # divided per term where the sum may overflow
                lambda s, p: (s / (1 if sum_may_overflow(s.dtype) else num_microbatches)
                              ).astype(jnp.result_type(p)),
                grad_sum, params)
        else:  # a total weight of 0 is NaN, as the full batch's mean over no tokens
            work = _wide_real(losses.dtype, share_dtype)
            loss = jnp.sum(jnp.where(shares > 0, shares.astype(work) * losses.astype(work), 0))
            loss = jnp.where(total > 0, loss, jnp.nan).astype(losses.dtype)
            grads = jax.tree.map(
                lambda s, p: jnp.where(total > 0, s, jnp.nan).astype(jnp.result_type(p)),
                grad_sum, params)
        if has_aux:
            return (loss, _combine_aux(aux, aux_combine, accum_dtype)), grads
        return loss, grads

    return grad_fn


def multi_steps(optimizer, every_k: int, *, skip_non_finite: bool = True):
    """`optax.MultiSteps(optimizer, every_k)` as a GradientTransformation.

    Feed it one micro-batch's gradients per `update` call (one jit call per
    micro-batch); the inner optimizer steps on the mean gradient every
    `every_k` calls and the returned updates are zero in between. Follow the
    loss-scale convention: pass `loss_scale.unscale(grads)` and call
    `loss_scale.adjust(all_finite(grads))` per micro-step (so a
    `DynamicLossScale`'s `growth_interval` counts micro-steps: 2000 is
    2000 / every_k optimizer steps). With
    `skip_non_finite` a micro-step with inf/nan gradients is dropped (not
    accumulated, not counted toward `every_k`; params and the state's
    accumulators stay unchanged). The state's `mini_step` is 0 right after
    an optimizer step. The accumulators are optax's, float32 for every leaf
    (its `accumulator_dtype`): complex or float64 params are refused at `init`,
    since their gradients would lose the imaginary part or be rounded to f32
    between micro-steps; `accumulate_gradients` takes an `accum_dtype`. Every
    micro-step counts alike (optax.MultiSteps takes a plain mean): for a loss
    over masked tokens use `accumulate_gradients(..., weight_fn=...)`.
    """
    import optax  # noqa: PLC0415

    if not is_int(every_k) or every_k < 1:
        raise ValueError(f"every_k={every_k!r} must be a positive int")
    skip = optax.skip_not_finite if skip_non_finite else None
    inner = optax.MultiSteps(optimizer, every_k_schedule=int(every_k),
                             should_skip_update_fn=skip).gradient_transformation()

    # optax.MultiSteps mixes int32 counters with floats internally, which
    # `jax_numpy_dtype_promotion="strict"` rejects; its arithmetic is ours to
    # scope, so run it under standard promotion whatever the caller set.
    def init(params):
        _check_real_32(params)
        with jax.numpy_dtype_promotion("standard"):
            return inner.init(params)

    def update(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra_args)
    return optax.GradientTransformationExtraArgs(init, update)


def _check_real_32(params) -> None:
    """Refuses leaves optax.MultiSteps' float32 accumulator would corrupt: complex ones lost
    the imaginary part of every micro-step but the last (the mean of 1j and 3j came out
    1.5j), float64 ones were rounded to float32."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    bad = [f"{jax.tree_util.keystr(path)}: {jnp.result_type(leaf)}" for path, leaf in leaves
           if jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating)
           or jnp.result_type(leaf) == jnp.float64]
    if bad:
        raise ValueError(f"multi_steps accumulates in optax.MultiSteps' float32 accumulators; "
                         f"expected params of at most 32-bit real dtypes, got {bad}. Use "
                         "accumulate_gradients(..., accum_dtype=...) for these.")


def data_parallel_value_and_grad(loss_fn: Callable[..., Any], num_microbatches: int,
                                 axis_name: str = "data", *, accum_dtype=jnp.float32,
                                 has_aux: bool = False, aux_combine: str = "mean",
                                 weight_fn: Callable[[Any], Any] | None = None):
    """`accumulate_gradients` for use inside `jax.shard_map` over `axis_name`.

    Each device accumulates its local micro-batches with `lax.scan`; then one
    `lax.psum` of `(loss, grads)` (then divided by the number of devices) runs
    after the scan, so the step has a single all-reduce however many
    micro-batches there are (XLA keeps one per dtype it cannot merge: on CPU
    float16 leaves got their own next to the float32 / bfloat16 one). Aux values (with
    `has_aux`) stay per-device. With `weight_fn` (see `accumulate_gradients`)
    devices count in proportion to their batch's weight too (one more, scalar,
    `lax.psum`, of the weights). Float16 leaves are divided by the number of
    devices (or scaled by their weight's share) before the sum, which would
    otherwise overflow where the mean does not.

    Returns:
      `fn(params, local_batch, *extra) -> (loss, grads)` (or
      `((loss, aux), grads)`), loss and grads averaged over devices.
    """
    local = accumulate_gradients(loss_fn, num_microbatches, accum_dtype=accum_dtype,
                                 has_aux=has_aux, aux_combine=aux_combine, weight_fn=weight_fn)

    def fn(params, batch, *extra):
        out, grads = local(to_varying(params, axis_name), batch, *extra)
        loss, aux = out if has_aux else (out, None)
        weight = None if weight_fn is None else batch_weight(weight_fn, batch)
        loss, grads = _device_mean((loss, grads), axis_name, weight)
        return ((loss, aux), grads) if has_aux else (loss, grads)
    return fn


def _device_mean(tree, axis_name, weight=None):
    """`lax.pmean(tree, axis_name)`, or with `weight` the weighted mean sum(w * x) / sum(w),
    in one `lax.psum` of `tree`.

    Each float16 term is scaled before the sum, which could overflow: a psum of n float16
    means (loss-scaled gradients) passes 65,504 where their mean does not, and so does
    x * n * w / sum(w) on a device holding most of the weight (`weighted_share` with
    `narrow_as_sum`). bf16 and f32 leaves are summed, then divided once.
    """
    n = lax.psum(1, axis_name)
    if weight is None:
        terms = jax.tree.map(lambda x: mean_term(x, n, x.dtype), tree)
    else:
        terms = weighted_share(tree, weight, axis_name, narrow_as_sum=True)
    summed = lax.psum(terms, axis_name)
    return jax.tree.map(lambda s: s if sum_may_overflow(s.dtype) else s / n, summed)


def weighted_share(tree, weight: jax.Array, axis_name, *, narrow_as_sum: bool = False) -> Any:
    """This device's `tree` scaled so that its mean over `axis_name` is the weighted mean.

    Call inside `jax.shard_map`: each leaf x becomes x * n * w / sum(w) (n devices,
    w this device's `weight`, the sum a scalar `lax.psum`), so the usual
    `pmean` (or sum / n) that follows gives sum(w * x) / sum(w). The factor is about
    1 while devices hold similar weights, but up to n on a device holding most of it,
    which can take loss-scaled fp16 gradients (and that pmean's sum) past 65,504;
    `data_parallel_value_and_grad` scales by w / sum(w) instead, and so does this
    with `narrow_as_sum` for the leaves whose sum may overflow (`sum_may_overflow`:
    fp16): their plain *sum* over devices is then the weighted mean. It is applied in
    f32 and the leaf keeps its dtype. A device of weight 0 contributes 0 (its own mean
    over no tokens may be NaN); a total weight of 0 makes every leaf NaN.
    """
    weight = jnp.asarray(weight, jnp.float32)
    total = lax.psum(weight, axis_name)
    n = lax.psum(1, axis_name)

    def one(x):
        factor = weight / total if narrow_as_sum and sum_may_overflow(x.dtype) else weight * n / total
        scaled = jnp.where(weight > 0, x.astype(jnp.float32) * factor, 0)
        return jnp.where(total > 0, scaled, jnp.nan).astype(x.dtype)
    return jax.tree.map(one, tree)
