"""The per-leaf ZeRO layout, used by `jaxopt-train bench train --zero 1` and the trainer's
`--zero 1` and `--zero 3`.

The flat layout (`jaxopt_train.zero.layout`) moves the whole model in ONE
reduce-scatter and ONE all-gather, which can start only once every gradient
exists (and end before any parameter is used). Splitting each leaf along one
of its own dimensions (`shard_dim`) gives one collective per leaf instead: a
leaf's reduce-scatter can start as soon as the backward has produced its
gradient, and a leaf's all-gather needs to finish only before the forward
first reads it. XLA's latency-hiding scheduler then overlaps them with
compute. No flattening copies, no padding. Leaves with no divisible dimension
stay replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.collectives import METHODS as ALL_REDUCE_METHODS
from jaxopt_train.collectives import all_reduce_tree
from jaxopt_train.collectives._axis import axis_size
from jaxopt_train.zero._checks import _check, _check_axis_name, _check_num_shards, _mesh_axis_size


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
    init run on a placeholder). A copy of `optax.masked` or
    `optax.multi_transform` holds an `optax.MaskedNode` (no arrays) in place of
    each parameter its inner optimizer skips; those are kept as they are.
    Only elementwise optimizers (Adam, AdamW, SGD) give the replicated result
    when each device updates its shard; ones that mix elements across a leaf or
    the tree (global-norm clipping, factored moments) do not, and the latter
    are refused here.

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
        if isinstance(leaf, optax.MaskedNode):  # a parameter the inner optimizer skips
            return leaf
        if tuple(leaf.shape) != tuple(param.shape):
            mismatched.append(f"{tuple(leaf.shape)} vs param {tuple(param.shape)}")
        return spec

    try:
        # MaskedNode is an empty pytree: as a leaf it stands where the params have an array.
        specs = optax.tree_utils.tree_map_params(optimizer, match, opt_state, param_specs, params,
                                                 transform_non_params=lambda _: P(),
                                                 is_leaf=lambda x: isinstance(x, optax.MaskedNode))
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

    Raises:
      ValueError: like `gather_leaves`, and for a `method` that `all_reduce_tree`
        does not take (checked even when no leaf is replicated, so that a
        misspelt method fails on every tree, not only on some).
    """
    if method not in ALL_REDUCE_METHODS:
        raise ValueError(f"{method=} must be one of {ALL_REDUCE_METHODS} (the all-reduce of the "
                         "replicated leaves, see jaxopt_train.collectives.all_reduce_tree)")
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
