"""What a value's type says about its sharding: varying mesh axes, and explicit sharding.

Inside `jax.shard_map` with varying-axes checking each value is typed with the mesh
axes along which it may differ between devices. Differentiating a replicated
(invariant) value against varying data makes JAX insert a psum in the backward pass,
and a custom VJP must return cotangents typed like its inputs; both are handled by
casting values to "varying" up front. Outside shard_map, and under `check_vma=False`,
nothing carries varying axes and those helpers are no-ops.

Outside shard_map, an array on a mesh with Explicit axes (`jax.make_mesh`'s default)
carries its PartitionSpec in its type (`explicit_sharding`): reshapes and slices of it
then need an out_sharding, and `pallas_call` refuses it.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """Mesh axes along which `x` varies inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10+
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # older spelling


def varying_axes_of_tree(tree) -> tuple[str, ...]:
    """Mesh axes along which any array leaf of `tree` varies, sorted."""
    axes = set()
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "dtype"):
            axes |= varying_axes(leaf)
    return tuple(sorted(axes))


def to_varying(tree, axis_names: str | tuple[str, ...]):
    """Every array leaf of `tree` cast to vary along `axis_names` too (`lax.pcast`)."""
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    # Only shard_map's (and pmap's) manual axes have a varying type; pcast of any
    # other name (a vmap axis, or none bound) raises "should be called under jax.shard_map".
    manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)

    def one(x):
        if not hasattr(x, "dtype"):
            return x
        missing = tuple(a for a in axis_names if a in manual and a not in varying_axes(x))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)  # jax < 0.9 spelling
    return jax.tree.map(one, tree)


def explicit_sharding(x) -> jax.sharding.PartitionSpec | None:
    """`x`'s PartitionSpec when its type carries explicit sharding (a mesh with Explicit
    axes, `jax.make_mesh`'s default), else None."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if spec is not None and any(p is not None for p in spec) else None
