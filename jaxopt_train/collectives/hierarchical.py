"""Two-level all-reduce: reduce-scatter inside a group, all-reduce across groups, all-gather inside.

Inside a host the links are fast (NVLink) and across hosts slow (network):
the hierarchical scheme sends only 1/g of the data (g = devices per host)
over the slow links, where a flat ring would cross them with every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxopt_train._checks import is_int
from jaxopt_train.collectives._axis import AxisName, axis_names, axis_size, check_ring_order
from jaxopt_train.collectives.ring import _Ring, all_reduce_rings, axis_rings, single_ring


def hierarchical_all_reduce(x, inner_axis: AxisName, outer_axis: AxisName, *, wire_dtype=None,
                            num_chunks: int = 1):
    """Sums `x` over both axes of a 2-D mesh (devices in a host x hosts); equals `lax.psum(x, (outer, inner))`.

    Ring reduce-scatter over `inner_axis`, ring all-reduce of the shard over
    `outer_axis`, ring all-gather over `inner_axis`. Accumulation is in f32
    for inputs narrower than 32 bits, across both stages.

    Args:
      x: this device's array, any shape (padded internally).
      inner_axis: the fast axis (devices of one host), or a tuple of axes.
      outer_axis: the slow axis (hosts), or a tuple of axes; none shared with `inner_axis`.
      wire_dtype: dtype of partial sums in flight (default `x.dtype`).
      num_chunks: independent pipelined rings per shard.
    """
    if set(axis_names(inner_axis)) & set(axis_names(outer_axis)):
        raise ValueError(f"{inner_axis=} and {outer_axis=} must be two different mesh axes "
                         "(a shared axis would be summed twice)")
    # Each ring list is major axis first; the innermost (fastest) ring runs first.
    rings = axis_rings(inner_axis)[::-1] + axis_rings(outer_axis)[::-1]
    return all_reduce_rings(x, rings, wire_dtype=wire_dtype, num_chunks=num_chunks)


def group_rings(axis_name: AxisName, group_size: int,
                ring_order: Sequence[int] | None = None) -> tuple[_Ring, _Ring]:
    """Inner and outer rings that split one axis into consecutive groups of `group_size`.

    Groups are consecutive blocks of `ring_order` (default axis order), which
    is how `jax.make_mesh` lays out devices of one process, so a 1-D "data"
    axis can be reduced hierarchically without a 2-D mesh.
    """
    axis_name = single_ring(axis_name).axis_name  # one axis (a 1-tuple names it), bound here
    n = axis_size(axis_name)
    order = check_ring_order(ring_order, n)
    if not is_int(group_size) or group_size < 1 or n % group_size:
        raise ValueError(f"{group_size=} must be a positive divisor of the size {n} of axis {axis_name!r}")
    group_size = int(group_size)
    groups = tuple(order[g: g + group_size] for g in range(0, n, group_size))
    across = tuple(tuple(group[i] for group in groups) for i in range(group_size))
    return _Ring(axis_name, groups), _Ring(axis_name, across)


def grouped_all_reduce(x, axis_name: AxisName, group_size: int, *, ring_order: Sequence[int] | None = None,
                       wire_dtype=None, num_chunks: int = 1):
    """Hierarchical all-reduce over one axis split into groups of `group_size`; equals `lax.psum`."""
    inner, outer = group_rings(axis_name, group_size, ring_order)
    return all_reduce_rings(x, [inner, outer], wire_dtype=wire_dtype, num_chunks=num_chunks)
