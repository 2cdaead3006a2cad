"""Validation of mapped axis names, shared by every collective."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from jax import lax

from jaxopt_train._checks import is_int

AxisName = Hashable


def axis_size(axis_name: AxisName) -> int:
    """Returns the size of a mapped axis, or raises a ValueError that says how to bind it.

    Args:
      axis_name: an axis bound by an enclosing `jax.shard_map` mesh or `jax.pmap(axis_name=...)`.

    Raises:
      TypeError: for a name that cannot name a mesh axis (see `check_name`).
      ValueError: if the axis is not bound here (JAX itself raises a bare NameError).
    """
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        check_name(name, axis_name)
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"{axis_name=} is not a mapped axis here; call this inside jax.shard_map(..., mesh=mesh) "
            f"whose mesh has that axis name, or inside jax.pmap(..., axis_name={axis_name!r})"
        ) from err


def check_name(name, axis_name: AxisName) -> None:
    """Refuses a `name` (one entry of `axis_name`) that cannot name a mapped axis.

    An unhashable name failed deep inside JAX with "unhashable type", and an
    int is read by `lax` as a positional array axis, which failed with "axis 0
    is out of bounds for array of dimension 0".
    """
    if not isinstance(name, Hashable) or isinstance(name, (int, np.integer)):
        raise TypeError(f"{axis_name=} must be a mesh axis name such as 'data' or a tuple of them; "
                        f"got a name of type {type(name).__name__}")


def axis_names(axis_name: AxisName) -> tuple[AxisName, ...]:
    """The axis names `axis_name` spans: `(axis_name,)` for one axis, the names of a tuple / list.

    Raises:
      TypeError: for a name that cannot name a mesh axis (see `check_name`).
      ValueError: for an empty tuple or a name repeated in it (`lax.psum` would sum twice).
    """
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for name in names:
        check_name(name, axis_name)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{axis_name=} must be one mesh axis name or a tuple of distinct names")
    return names


def check_permutation(name: str, order: Sequence[int], size: int) -> tuple[int, ...]:
    """`order` as a tuple of ints if it is a permutation of `0..size-1`, else a ValueError naming `name`.

    Only ints and numpy integers count as indices: `int(i)` would truncate a
    float and let a bool or a digit string through. Shared by the collectives'
    `ring_order=` and `topology`, so both refuse the same inputs the same way.
    """
    try:
        items = None if isinstance(order, (str, bytes)) else tuple(order)  # bytes iterate as ints
    except TypeError:  # not iterable
        items = None
    if (items is None or not all(is_int(i) for i in items)
            or sorted(int(i) for i in items) != list(range(size))):
        raise ValueError(f"{name}={order!r} must be a permutation of 0..{size - 1} (one index per device), "
                         f"a sequence of ints")
    return tuple(int(i) for i in items)


def check_ring_order(ring_order: Sequence[int] | None, size: int) -> tuple[int, ...]:
    """Validates an explicit ring: a permutation of the axis indices `0..size-1`.

    Returns the identity ring when `ring_order` is None.
    """
    if ring_order is None:
        return tuple(range(size))
    return check_permutation("ring_order", ring_order, size)
