"""Ring order from the machine topology, and a printable description of a ring.

A ring is only as fast as its slowest hop, so neighbours on the ring should be
neighbours on the hardware: devices of one process (one host) contiguous, then
across processes (one slow hop in each direction per host boundary); on TPU a
snake through the chip coordinates; on GPUs, where NVML reports NVLinks,
consecutive devices that share the most links.

The result is a permutation of indices into `devices`. Either build the mesh in
that order (`jax.make_mesh(..., devices=[devices[i] for i in order])`, then the
default ring is already right) or pass it as `ring_order=` to the collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxopt_train.collectives._axis import check_permutation
from jaxopt_train.runtime.nvml import as_text, nvml_indices, nvml_session


def _snake_keys(devices: Sequence[Any]) -> list[tuple]:
    """Sort keys walking TPU coords (x, y, z) as a boustrophedon: z layer by layer, y
    reversed on odd layers, x reversed on every odd row of the whole sweep.

    On a full X x Y x Z block of chips each step is one hop (cores of one chip
    are adjacent). The closing hop, last back to first, spans
    ``(Z - 1) + (Y - 1 if Z is odd else 0) + (X - 1 if Y * Z is odd else 0)``
    links (fewer where the slice has torus wrap-around links): 1 on 2x2x1 and
    2x2x2, 3 on 4x4x1. Coordinates are ranked first, so a host's block need not
    start at 0; on a block with chips missing a step may be longer.
    """
    coords = [(tuple(d.coords) + (0, 0, 0))[:3] for d in devices]
    ranks = [{v: r for r, v in enumerate(sorted({c[a] for c in coords}))} for a in range(3)]
    width, depth = len(ranks[0]), len(ranks[1])
    keys = []
    for device, (x, y, z) in zip(devices, coords):
        x, y, z = ranks[0][x], ranks[1][y], ranks[2][z]
        # Reversing y on odd layers makes a layer start above where the last one ended;
        # x's parity counts rows over the whole sweep, not within a layer, for the same reason.
        y = y if z % 2 == 0 else depth - 1 - y
        x = x if (z * depth + y) % 2 == 0 else width - 1 - x
        keys.append((z, y, x, getattr(device, "core_on_chip", 0)))
    return keys


def nvlink_counts(devices: Sequence[Any]) -> list[list[int]] | None:
    """NVLink counts between GPU `devices` (by CUDA ordinal), or None where NVML cannot say.

    Reads NVML lazily (`runtime.nvml`); any failure (no driver, no NVLink, CPU
    devices) returns None so callers fall back to id order.
    """
    if not devices or any(getattr(d, "platform", "") != "gpu" for d in devices):
        return None
    # NVML numbers every GPU of the host; under CUDA_VISIBLE_DEVICES=2,3 JAX's GPU 0 is
    # NVML's 2, so its own id would read another GPU's links.
    indices, _ = nvml_indices(devices)
    if indices is None:
        return None
    with nvml_session() as (nvml, _):
        if nvml is None:
            return None
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            bus = [as_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
            counts = [[0] * len(devices) for _ in devices]
            for i, handle in enumerate(handles):
                for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                    try:
                        if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                            continue
                        remote = as_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
                    except nvml.NVMLError:
                        continue
                    for j, other in enumerate(bus):
                        if j != i and other == remote:
                            counts[i][j] += 1
            return counts
        except Exception:  # noqa: BLE001 (partial NVML support: treat as no information)
            return None


def _greedy_by_links(indices: list[int], counts: list[list[int]]) -> list[int]:
    """Walks from the first device, always to the unvisited neighbour with the most links."""
    order, rest = [indices[0]], list(indices[1:])
    while rest:
        here = order[-1]
        best = max(rest, key=lambda j: (counts[here][j], -rest.index(j)))
        order.append(best)
        rest.remove(best)
    return order


def ring_order(devices: Sequence[Any], *, override: Sequence[int] | None = None,
               use_nvml: bool = True) -> tuple[int, ...]:
    """Indices into `devices` in the order a ring should visit them.

    Args:
      devices: e.g. `mesh.devices.flat` or `jax.devices()`.
      override: an explicit order (validated as a permutation), returned as is.
      use_nvml: order GPUs of one process by NVLink counts when NVML reports them.

    Returns:
      A permutation of `range(len(devices))`: devices grouped by process (in
      process order), within a process by TPU coords (snake) where present,
      else by NVLink neighbourhood, else by device id.
    """
    n = len(devices)
    if override is not None:
        return check_permutation("override", override, n)
    by_process: dict[int, list[int]] = {}
    for i, device in enumerate(devices):
        by_process.setdefault(getattr(device, "process_index", 0), []).append(i)
    order: list[int] = []
    for process in sorted(by_process):
        local = by_process[process]
        if all(getattr(devices[i], "coords", None) is not None for i in local):
            keys = _snake_keys([devices[i] for i in local])
            local = [i for _, i in sorted(zip(keys, local))]
        else:
            local = sorted(local, key=lambda i: devices[i].id)
            counts = nvlink_counts([devices[i] for i in local]) if use_nvml else None
            if counts is not None and any(map(any, counts)):
                positions = _greedy_by_links(list(range(len(local))), counts)
                local = [local[p] for p in positions]
        order.extend(local)
    return tuple(order)


def describe_ring(devices: Sequence[Any], order: Sequence[int] | None = None) -> str:
    """One line per hop of the ring, marking hops that leave a process.

    `order` is a permutation of `range(len(devices))` (default: list order),
    e.g. from `ring_order(devices)`.

    Example output: `ring over 8 devices (2 processes, 2 cross-process hops):`
    followed by lines such as `  0: cpu:0 [p0] -> cpu:1 [p0]`, a hop between processes
    ending in `   (cross-process)`.
    """
    order = tuple(range(len(devices))) if order is None else check_permutation("order", order, len(devices))
    n = len(order)
    processes = {getattr(devices[i], "process_index", 0) for i in order}
    lines, crossings = [], 0
    for pos in range(n):
        a, b = devices[order[pos]], devices[order[(pos + 1) % n]]
        pa, pb = getattr(a, "process_index", 0), getattr(b, "process_index", 0)
        cross = pa != pb
        crossings += cross
        lines.append(f"  {pos}: {a} [p{pa}] -> {b} [p{pb}]" + ("   (cross-process)" if cross else ""))
    plural = lambda count, word: f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"  # noqa: E731
    head = (f"ring over {plural(n, 'device')} ({plural(len(processes), 'process')}, "
            f"{plural(crossings, 'cross-process hop')}):")
    return "\n".join([head] + lines)
