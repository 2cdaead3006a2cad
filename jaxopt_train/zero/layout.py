"""The flat ZeRO layout: every parameter in one vector, padded and split evenly over n devices.

Device i owns elements `[i*s, (i+1)*s)` (s = padded/n) of the parameters, of their
gradient and of the optimizer state. The collectives here move that vector: one
reduce-scatter of the gradients, one all-gather of the parameters, either the ring
collectives of `jaxopt_train.collectives` (`method="ring"`) or XLA's own
(`method="psum"`: `lax.psum_scatter` / `lax.all_gather`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxopt_train._trees import leaf_path_diff
from jaxopt_train._typed_sharding import explicit_sharding
from jaxopt_train.collectives import ring_all_gather, ring_reduce_scatter
from jaxopt_train.zero._checks import _check_has_leaves, _check_num_shards


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
        if explicit_sharding(flat) is not None:
            # Typed with explicit sharding (jax.make_mesh's default axes), its slices would
            # each need an out_sharding: gather the vector first, as the leaves are whole.
            mesh = jax.typeof(flat).sharding.mesh
            flat = jax.sharding.reshard(flat, jax.sharding.NamedSharding(mesh, P()))
        leaves, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            leaves.append(flat[offset: offset + size].reshape(shape))
            offset += size
        return jax.tree.unflatten(self.treedef, leaves)


def make_layout(params, num_shards: int) -> FlatLayout:
    """The flat layout of `params` (all leaves one floating dtype) over `num_shards` devices.

    Raises:
      ValueError: for a tree with no leaves, leaves of several or non-floating
        dtypes, or a `num_shards` that is not a positive int.
    """
    leaves, treedef = jax.tree.flatten(params)
    _check_has_leaves(leaves, "params")
    # jnp.result_type, as `FlatLayout.check` reads them: a Python float leaf (which optax
    # takes) has no .dtype, and failed here with an AttributeError.
    dtypes = {np.dtype(jnp.result_type(x)) for x in leaves}
    if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
        raise ValueError(f"ZeRO sharding needs parameters of one floating dtype; got {sorted(map(str, dtypes))} "
                         "(cast them to the param dtype first)")
    _check_num_shards(num_shards)
    return FlatLayout(treedef, tuple(tuple(np.shape(x)) for x in leaves), dtypes.pop(), int(num_shards))


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
