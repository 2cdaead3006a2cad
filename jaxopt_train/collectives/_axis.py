"""Validation of mapped axis names, shared by every collective."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from jax import lax

AxisName = Hashable


def axis_size(axis_name: AxisName) -> int:
    """Returns the size of a mapped axis, or raises a ValueError that says how to bind it.

    Args:
      axis_name: an axis bound by an enclosing `jax.shard_map` mesh or `jax.pmap(axis_name=...)`.

    Raises:
      ValueError: if the axis is not bound here (JAX itself raises a bare NameError).
    """
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"{axis_name=} is not a mapped axis here; call this inside jax.shard_map(..., mesh=mesh) "
            f"whose mesh has that axis name, or inside jax.pmap(..., axis_name={axis_name!r})"
        ) from err


def check_ring_order(ring_order: Sequence[int] | None, size: int) -> tuple[int, ...]:
    """Validates an explicit ring: a permutation of the axis indices `0..size-1`.

    Returns the identity ring when `ring_order` is None.
    """
    if ring_order is None:
        return tuple(range(size))
    order = tuple(int(i) for i in ring_order)
    if sorted(order) != list(range(size)):
        raise ValueError(
            f"{ring_order=} must be a permutation of the axis indices 0..{size - 1} "
            f"(the axis has {size} devices)"
        )
    return order
