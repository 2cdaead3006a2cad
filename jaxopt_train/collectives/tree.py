"""`all_reduce_tree`: the gradient-pytree all-reduce with a choice of algorithm."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxopt_train.collectives import buckets as buckets_lib
from jaxopt_train.collectives import compression as compression_lib
from jaxopt_train.collectives._axis import AxisName, axis_names, axis_size
from jaxopt_train.collectives.hierarchical import group_rings
from jaxopt_train.collectives.peer import DTYPES as PEER_DTYPES
from jaxopt_train.collectives.peer import peer_all_reduce
from jaxopt_train.collectives.ring import _check_num_chunks, _Ring, all_reduce_rings, single_ring

METHODS = ("psum", "ring", "ring_bidir", "hierarchical", "peer")


def _default_group_size(n: int) -> int:
    """Devices per process when every process holds the same number and it splits the axis
    into whole groups, else the whole axis. Counted from the global device list, so every
    process picks the same size: from its own local count, a process of 4 devices and one
    of 2 traced different rings and the all-reduce deadlocked."""
    per_process = collections.Counter(d.process_index for d in jax.devices()).values()
    local = min(per_process)
    same = local == max(per_process)
    return local if same and 0 < local <= n and n % local == 0 else n


def _hierarchy(axis_name, group_size, ring_order) -> list[_Ring]:
    if isinstance(axis_name, tuple):
        if len(axis_name) != 2:
            raise ValueError(f"method='hierarchical' takes one axis or a pair (outer_axis, inner_axis); got {axis_name=}")
        if ring_order is not None or group_size is not None:
            raise ValueError("ring_order= and group_size= apply to a single axis, not to a (outer, inner) pair")
        outer, inner = axis_name
        return [single_ring(inner), single_ring(outer)]
    n = axis_size(axis_name)
    inner, outer = group_rings(axis_name, _default_group_size(n) if group_size is None else group_size, ring_order)
    return [inner, outer]


def _reducer(method: str, axis_name, *, ring_order, group_size, num_chunks, wire_dtype):
    """The function flat -> sum over the axis for one bucket, by `method`."""
    if method == "psum":
        return lambda flat: lax.psum(flat, axis_name)

    def wire(flat):  # integer buckets keep their own dtype on the wire: exact, as psum's
        return wire_dtype if jnp.issubdtype(flat.dtype, jnp.floating) else None

    if method == "peer":  # the kernel moves floats; other buckets (integer leaves) go through psum
        return lambda flat: (peer_all_reduce(flat, axis_name, wire_dtype=wire(flat)) if flat.dtype in PEER_DTYPES
                             else lax.psum(flat, axis_name))
    if method == "hierarchical":
        rings = _hierarchy(axis_name, group_size, ring_order)
    else:
        rings = [single_ring(axis_name, ring_order)]
    bidirectional = method == "ring_bidir"
    return lambda flat: all_reduce_rings(flat, rings, num_chunks=num_chunks, bidirectional=bidirectional,
                                         wire_dtype=wire(flat))


def _check_wire_dtype(wire_dtype, method: str, compression):
    """The floating dtype partial sums travel in, or None; refused where it would be ignored."""
    if wire_dtype is None:
        return None
    if method == "psum" or compression is not None:
        raise ValueError(f"wire_dtype= sets what the ring and peer methods send; got {wire_dtype=} with "
                         f"{method=}, {compression=} (psum's wire is XLA's; compression's is its codec)")
    try:
        wire = jnp.dtype(wire_dtype)
    except TypeError as err:
        raise TypeError(f"wire_dtype={wire_dtype!r} is not a dtype; expected a floating one such as "
                        "jnp.float32 or jnp.bfloat16") from err
    if not jnp.issubdtype(wire, jnp.floating):
        raise TypeError(f"wire_dtype={wire} must be a floating dtype (it carries the floating buckets; "
                        "integer buckets keep their own)")
    return wire


def _check_method_options(method: str, ring_order, group_size, num_chunks, compression) -> None:
    """Refuses options the chosen method would silently ignore."""
    # Checked first: True or 1.0 compare equal to 1 and slipped past the checks below, and
    # the ring checks it only once an uncompressed bucket reaches it (never for a float-only
    # compressed tree, so num_chunks=0 went through there too).
    _check_num_chunks(num_chunks)
    if num_chunks != 1 and method == "psum":
        raise ValueError(f"num_chunks= applies to the ring methods ('ring', 'ring_bidir', 'hierarchical'); "
                         f"got {num_chunks=} with {method=} (drop num_chunks or pick a ring method)")
    # The compressed exchange sends each float bucket whole; chunking only the
    # integer buckets would leave num_chunks meaning nothing for the gradients.
    if num_chunks != 1 and compression is not None:
        raise ValueError(f"num_chunks= pipelines the uncompressed ring methods; the compressed exchange sends "
                         f"each bucket whole; got {num_chunks=} with {compression=} "
                         f"(drop num_chunks or compression)")
    # The compressed exchange goes over the flat ring of the whole axis; groups
    # would shape only the integer buckets, leaving group_size meaningless for the gradients.
    if group_size is not None and compression is not None:
        raise ValueError(f"group_size= groups the uncompressed hierarchical reduction; the compressed exchange "
                         f"runs over the whole axis; got {group_size=} with {compression=} "
                         f"(drop group_size or compression)")
    if ring_order is not None and method in ("psum", "peer"):
        raise ValueError(f"ring_order= applies to the ring methods ('ring', 'ring_bidir', 'hierarchical'); "
                         f"got {ring_order=} with {method=} (drop ring_order or pick a ring method)")
    if group_size is not None and method != "hierarchical":
        raise ValueError(f"group_size= applies to method='hierarchical' only; got {group_size=} with {method=}")


def _error_leaves(error_state, treedef, leaves) -> list:
    """The leaves of `error_state.error` in gradient-leaf order, checked against the gradients."""
    if not isinstance(error_state, compression_lib.ErrorFeedbackState):
        raise TypeError(f"error_state must be an ErrorFeedbackState, built with init_error_feedback(params); "
                        f"got {type(error_state).__name__}")
    try:
        errors = treedef.flatten_up_to(error_state.error)
    except (TypeError, ValueError) as err:
        raise ValueError(f"error_state.error must have the gradient tree's structure {treedef}; build it "
                         f"with init_error_feedback(params) ({err})") from None
    for leaf, error in zip(leaves, errors):
        _check_error_dtype(error)
        # The leaf's own shape, or with the leading device axis of 1 that shard_map leaves of
        # init_error_feedback(params, n). Sizes alone let a transposed (6, 4) error for a
        # (4, 6) gradient through, fed back into the wrong elements.
        if jnp.shape(error) not in (leaf.shape, (1,) + leaf.shape):
            raise ValueError(f"error_state leaf of shape {jnp.shape(error)} does not match gradient leaf of "
                             f"shape {leaf.shape} (expected {leaf.shape} or {(1,) + leaf.shape}); build it "
                             "with init_error_feedback(params)")
    return errors


def _check_error_dtype(error) -> None:
    """Refuses an error leaf that is not an f32 array: a Python float failed on `.astype`, a
    complex one lost its imaginary part unnoticed, and any other dtype came back as f32, so a
    `lax.scan` or `select_tree` carrying the state no longer matched its input."""
    dtype = getattr(error, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.float32:
        given = f"dtype={dtype}" if dtype is not None else type(error).__name__
        raise TypeError(f"error_state leaves must be float32 arrays (the per-device compression error); "
                        f"got {given}; build the state with init_error_feedback(params)")


def _check_leaves(leaves):
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise TypeError(f"all_reduce_tree needs floating or integer array leaves; got a leaf of type "
                            f"{type(leaf).__name__} with dtype={dtype}")


def all_reduce_tree(tree: Any, axis_name: AxisName, *, method: str = "psum", bucket_mb: float = 25.0,
                    first_bucket_mb: float | None = None, compression: str | None = None,
                    error_state: compression_lib.ErrorFeedbackState | None = None,
                    ring_order: Sequence[int] | None = None, group_size: int | None = None,
                    num_chunks: int = 1, wire_dtype=None):
    """Sums every leaf of `tree` over `axis_name` (like `lax.psum`), in buckets, by the chosen algorithm.

    Call inside `jax.shard_map` or `jax.pmap`. Leaves are packed, last leaf
    first, into flat buckets of about `bucket_mb` (see `buckets.plan_buckets`);
    each bucket is one reduction. Without compression bucket size changes only
    which elements travel together, never an element's sum. With "int8" it
    also changes the rounding: the elements of one block of `INT8_BLOCK` share
    a scale, so a small leaf packed next to a large one is quantised in that
    large leaf's steps (error feedback re-sends what was lost; `bucket_mb=0`
    keeps every leaf's blocks its own).

    Ring methods, and every method with `compression` ("psum" included: its
    all-to-all and all-gather are per-device collectives), return values typed
    as varying over the axis, though every device holds the same bits: in
    `jax.shard_map` use `out_specs=P(axis)` for them or `check_vma=False`
    (`out_specs=P()` fails with "could not infer replication").

    Args:
      tree: pytree of floating or integer arrays (e.g. gradients).
      axis_name: mapped axis; for "hierarchical" also a pair (outer_axis, inner_axis).
      method: "psum" (XLA's all-reduce), "ring", "ring_bidir" (two opposite
        rings over halves), "hierarchical" (rings inside groups of
        `group_size` consecutive devices, default the devices of one process
        when every process holds as many, then across groups; in one process
        that default is one group, i.e. the flat ring: pass `group_size` to
        split it; the default assumes the axis runs over all devices in
        process order, so on a 2-D mesh pass the devices per process along
        this axis), or "peer" (2 Hopper GPUs in one process: one
        Mosaic GPU kernel stores into the peer's memory, see `peer`; with
        compression "bf16" only; buckets of other than f16/bf16/f32 leaves
        are summed by psum).
      bucket_mb: bucket size in MiB (0: one bucket per leaf, math.inf: one
        bucket per dtype).
      first_bucket_mb: size of the first bucket of each dtype (default
        min(1, bucket_mb); no cap when bucket_mb is math.inf).
      compression: None, "bf16" or "int8" (see `compression` module for the
        scheme and the error bound); floating leaves only, summed in f32.
        "ring", "ring_bidir" and "hierarchical" then all exchange the floating
        buckets over the one flat ring of the axis (in `ring_order`): no second
        direction, no groups; integer buckets still go through `method`.
      error_state: an `ErrorFeedbackState` from `init_error_feedback`, to
        carry compression error across steps; then the result is a pair.
      ring_order: axis indices in ring order for the ring methods (refused
        with "psum" and "peer", which would ignore it).
      group_size: devices per group for "hierarchical" on one axis (refused
        with the other methods, and with `compression`, which would ignore it).
      num_chunks: pipelined rings per shard for the ring methods (refused
        with "psum" and "peer", and with `compression`, which would ignore it).
      wire_dtype: the floating dtype the ring and peer methods send partial
        sums in (default each bucket's own). bf16 gradients on a bf16 wire
        round at every hop, as NCCL's ring does; `jnp.float32` sums them as
        exactly as psum at twice the bytes. Integer buckets keep their dtype.
        Refused with "psum" and with `compression`, which set their own wire.

    Returns:
      The summed tree (leaves keep shape and dtype), or
      `(summed_tree, new_error_state)` when `error_state` is given.
    """
    if method not in METHODS:
        raise ValueError(f"{method=} must be one of {METHODS}")
    # One hashable name or a tuple from here on: a list would slip past the
    # tuple checks below and then fail inside lax.all_to_all / ppermute.
    names = axis_names(axis_name)
    axis_name = names[0] if len(names) == 1 else names
    compression_lib.check_codec(compression)
    _check_method_options(method, ring_order, group_size, num_chunks, compression)
    if compression is not None and len(names) > 1:
        raise ValueError(f"compression runs over one axis; got {axis_name=}")
    if error_state is not None and compression is None:
        raise ValueError("error_state= is only used with compression='bf16' or 'int8'; got compression=None")
    if method in ("ring", "ring_bidir", "peer") and isinstance(axis_name, tuple):
        raise ValueError(f"method={method!r} runs over one axis; got {axis_name=} (use 'hierarchical' for a pair)")
    if method == "peer" and (num_chunks != 1 or compression == "int8"):
        raise ValueError(f"method='peer' sends each bucket in one kernel with a bf16 or unchanged wire; "
                         f"got {num_chunks=}, {compression=} (use method='ring' for those)")
    n = axis_size(axis_name)
    leaves, treedef = jax.tree.flatten(tree)
    _check_leaves(leaves)
    errors = None if error_state is None else _error_leaves(error_state, treedef, leaves)
    wire = _check_wire_dtype(wire_dtype, method, compression)
    reduce_flat = _reducer(method, axis_name, ring_order=ring_order, group_size=group_size, num_chunks=num_chunks,
                           wire_dtype=wire)
    exchange_ring = None
    if compression is not None and method not in ("psum", "peer"):  # "hierarchical" exchanges over the flat ring
        exchange_ring = single_ring(axis_name, ring_order)
    out: list = [None] * len(leaves)
    new_errors: list = [None] * len(leaves)
    for bucket in buckets_lib.plan_buckets(leaves, bucket_mb, first_bucket_mb):
        flat = buckets_lib.pack(bucket, leaves)
        if compression is None or not jnp.issubdtype(bucket.dtype, jnp.floating):
            buckets_lib.unpack(bucket, reduce_flat(flat), leaves, out)
            if errors is not None:
                for i in bucket.leaf_indices:
                    new_errors[i] = errors[i]
            continue
        error = None if errors is None else buckets_lib.pack(bucket, [e.astype(jnp.float32) for e in errors])
        summed, error = compression_lib.compressed_all_reduce(
            flat, axis_name, n, codec=compression, ring=exchange_ring, error=error, peer=method == "peer")
        buckets_lib.unpack(bucket, summed.astype(bucket.dtype), leaves, out)
        if error is not None:
            buckets_lib.unpack(bucket, error, errors, new_errors)
    reduced = jax.tree.unflatten(treedef, out)
    if error_state is None:
        return reduced
    return reduced, compression_lib.ErrorFeedbackState(jax.tree.unflatten(treedef, new_errors))

