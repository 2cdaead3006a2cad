"""Placing host batches on a mesh, sharded over its data axis.

With one process, `shard_batch` gets the whole global batch. With several
(`jax.distributed.initialize()`), each process loads only the rows that its
own devices hold, as told by `process_batch_slice`, and `shard_batch`
assembles the global `jax.Array` with `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxopt_train.data.sampling import check_positive_int


def _check_axis(mesh: Mesh, axis: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str):
        # A tuple of axes fell through to "axis=('model', 'data') is not an axis of the mesh;
        # its axes are ('model', 'data')", which contradicts itself.
        raise ValueError(f"axis={axis!r} must be the name of one mesh axis (a str), one of "
                         f"{mesh.axis_names}; a batch is sharded over a single data axis")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
    return mesh.shape[axis]


def _local_row_range(mesh: Mesh, axis: str, global_rows: int) -> tuple[int, int]:
    """The contiguous rows of a ``global_rows`` batch held by this process's devices."""
    index_map = NamedSharding(mesh, P(axis)).addressable_devices_indices_map((global_rows,))
    if not index_map:  # it was an IndexError on the empty list below
        raise ValueError(
            f"none of this process's devices (process {jax.process_index()}) are in the mesh, "
            f"so it holds no rows; build the mesh from jax.devices() (every process's devices), "
            f"got one of {mesh.devices.size} devices of processes "
            f"{sorted({d.process_index for d in mesh.devices.flat})}")
    bounds = sorted({(idx[0].start or 0, global_rows if idx[0].stop is None else idx[0].stop)
                     for idx in index_map.values()})
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        if stop != start:
            raise ValueError(
                f"this process's devices hold non-contiguous rows {bounds} of mesh axis "
                f"{axis!r}; build the mesh with each process's devices adjacent "
                "(jax.make_mesh does)"
            )
    return bounds[0][0], bounds[-1][1]


def process_batch_slice(global_batch_size: int, mesh: Mesh | None = None, axis: str = "data") -> slice:
    """Which rows of the global batch this process loads.

    Args:
      global_batch_size: Rows of the whole batch, over all processes.
      mesh: The training mesh. None only with one process (which loads
        everything); with several it is required.
      axis: The mesh's data axis.

    Returns:
      ``slice(start, stop)`` into the global batch (everything for one process).

    Raises:
      ValueError: ``mesh`` is None with more than one process.
    """
    check_positive_int("global_batch_size", global_batch_size)  # numpy ints too, as the datasets take
    global_batch_size = int(global_batch_size)
    if mesh is None:
        _check_one_process(global_batch_size, axis)
        return slice(0, global_batch_size)
    devices = _check_axis(mesh, axis)
    _check_divisible(global_batch_size, devices, axis)
    start, stop = _local_row_range(mesh, axis, global_batch_size)
    return slice(start, stop)


def _check_one_process(global_batch_size: int, axis: str) -> None:
    # Without the mesh the rows cannot be known: under ("model", "data") = (2, 4) over two
    # processes each holds every data shard and must load all rows, and equal shares in
    # process order would give each half. shard_batch sees the same shapes in the right
    # and the wrong case, so only this refusal keeps the wrong global batch from being silent.
    count = jax.process_count()
    if count > 1:
        raise ValueError(
            f"process_batch_slice needs the training mesh with more than one process, got mesh=None "
            f"with jax.process_count()={count}: a process loads the rows its devices hold along "
            f"mesh axis {axis!r}, which only the mesh tells; pass "
            f"process_batch_slice({global_batch_size}, mesh, {axis!r})"
        )


def _check_divisible(rows: int, devices: int, axis: str) -> None:
    if rows % devices:
        raise ValueError(
            f"batch size {rows} is not divisible by the {devices} devices of mesh axis "
            f"{axis!r}; use a multiple of {devices}"
        )


def shard_batch(batch: Any, mesh: Mesh, axis: str = "data") -> Any:
    """Returns ``batch`` (a pytree of arrays with a leading batch axis) as global
    `jax.Array` s sharded over ``mesh``'s ``axis`` and replicated over its other axes.

    With several processes each leaf holds only this process's rows, from
    ``process_batch_slice(global_batch_size, mesh, axis)``; the global batch is
    their concatenation. Processes whose devices hold the same shards must pass
    the same rows: shard_batch sees only this process's rows, so it cannot check
    that (``process_batch_slice`` refuses to guess without the mesh).

    Raises:
      ValueError: the leaves disagree on the batch size, or the global batch
        size is not divisible by the number of devices along ``axis``.
    """
    devices = _check_axis(mesh, axis)
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch has no arrays")
    rows = {jax.tree_util.keystr(path) or "batch": np.shape(leaf) for path, leaf in leaves}
    scalars = [name for name, shape in rows.items() if not shape]
    if scalars:
        raise ValueError(f"every batch leaf needs a leading batch axis; {', '.join(scalars)} are scalars "
                         "(a Python list of numbers is a pytree of scalars: pass np.asarray(list))")
    if len({shape[0] for shape in rows.values()}) != 1:
        sizes = ", ".join(f"{name}: {shape[0]}" for name, shape in rows.items())
        raise ValueError(f"every batch leaf needs the same leading batch size; got {sizes}")
    local = next(iter(rows.values()))[0]
    if local == 0:
        raise ValueError(f"batch has 0 rows; shard_batch needs at least one row per device of mesh axis {axis!r}")
    # This process holds `held` of the `devices` shards along the axis.
    start, stop = _local_row_range(mesh, axis, devices)
    held = stop - start
    global_rows = local * devices // held
    if local * devices % held:
        raise ValueError(
            f"this process's batch of {local} rows cannot be split over its {held} of the "
            f"{devices} shards of mesh axis {axis!r}; use a multiple of {held}"
        )
    _check_divisible(global_rows, devices, axis)

    def put(leaf):
        sharding = NamedSharding(mesh, P(axis))
        global_shape = (global_rows, *np.shape(leaf)[1:])
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf), global_shape)

    return jax.tree.map(put, batch)
