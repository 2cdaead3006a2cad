"""The 2-GPU all-reduce as one Mosaic GPU kernel that stores straight into the peer's memory.

`ring.exchange_all_reduce` on 2 devices is three kernels in a row: a cast to the
wire dtype, an NCCL send/recv (`lax.ppermute`) and an add. On two H200s the cast
and the add cost 1 ms of a 2.45 ms exchange at 1 GiB, and NCCL moves the bytes
through its own staging buffers. Here every CTA of one kernel reads a tile of
this device's data, rounds it to the wire dtype, keeps that copy and writes it
with plain stores through NVLink into the peer's receive buffer
(`plgpu.remote_ref`: the buffer is symmetric memory XLA allocates for the
kernel). Each CTA then signals its counterpart on the peer and waits for its own
signal, so the kernel returns once both halves of the exchange have landed. XLA
adds the two copies afterwards, as in the ppermute exchange, so both devices add
the same two values and the sums are bit identical.

Many small tiles keep enough stores in flight to fill the link: on two H200s
4 CTAs per SM with 1024-element tiles measured best (tools/probe_nvshmem.py,
BENCHMARKS.md). Requirements, checked at trace time with a clear error:
  - a CUDA GPU of compute capability >= 9.0 (Mosaic GPU), one process driving
    both GPUs (jax 0.11.2's XLA could not map the peer's buffer across
    processes: NCCL's ncclGetPeerDevicePointer failed there);
  - `jax.shard_map` over a mesh axis of exactly 2 devices (Mosaic GPU reads the
    peer's index from the mesh);
  - float16 / bfloat16 / float32 data and wire.
NVLink multicast is never used (unicast peer stores only). All Mosaic GPU
imports are lazy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxopt_train.collectives._axis import AxisName, axis_size
from jaxopt_train.collectives.ring import accumulation_dtype

DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
DEFAULT_TILE = 1024  # elements per tile; 512-2048 measured, 1024 best
DEFAULT_CTAS_PER_SM = 4


def check_platform(*, instead: str = "method='ring' or 'psum'") -> None:
    """Raises unless this process drives CUDA GPUs of compute capability >= 9.0 on its own.

    `instead`: what the message offers in its place (a command line names its flag)."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"the peer all-reduce is a Mosaic GPU kernel and needs CUDA GPUs; "
                         f"the default backend here is {backend!r} (use {instead})")
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    if compute_capability(jax.devices()[0]) < (9, 0):
        capability = getattr(jax.devices()[0], "compute_capability", "none")
        raise ValueError(f"the peer all-reduce needs compute capability >= 9.0 (Hopper); "
                         f"{jax.devices()[0].device_kind} has {capability}")
    if jax.process_count() > 1:
        raise NotImplementedError(
            f"the peer all-reduce needs one process driving both GPUs; this run has "
            f"{jax.process_count()} processes (XLA could not map a peer buffer across processes "
            f"in jax 0.11.2); use {instead}")


def _check_axis(axis_name: AxisName) -> None:
    if isinstance(axis_name, (tuple, list)):
        raise ValueError(f"the peer all-reduce runs over one mesh axis; got {axis_name=}")
    n = axis_size(axis_name)
    if n != 2:
        raise ValueError(f"the peer all-reduce exchanges between exactly 2 devices; axis {axis_name!r} "
                         f"has {n} (use method='ring' or 'hierarchical')")
    mesh = jax.sharding.get_abstract_mesh()
    if axis_name not in tuple(getattr(mesh, "axis_names", ()) or ()):
        raise ValueError(f"the peer all-reduce needs jax.shard_map over a mesh with axis {axis_name!r}: "
                         f"Mosaic GPU finds the peer through the mesh, and this context has none")


def _check_dtypes(x_dtype, wire_dtype) -> tuple[np.dtype, np.dtype]:
    x_dtype = np.dtype(x_dtype)
    wire = x_dtype if wire_dtype is None else np.dtype(wire_dtype)
    if x_dtype not in DTYPES or wire not in DTYPES:
        raise TypeError(f"the peer all-reduce takes float16, bfloat16 or float32 data and wire; "
                        f"got data {x_dtype} and wire {wire}")
    return x_dtype, wire


def _check_config(tile, ctas_per_sm) -> None:
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 512 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 512 (elements per CTA step); got {tile=}")
    if not isinstance(ctas_per_sm, int) or isinstance(ctas_per_sm, bool) or ctas_per_sm < 1:
        raise ValueError(f"ctas_per_sm must be a positive int; got {ctas_per_sm=}")


def _kernel_call(n_tiles: int, tile: int, grid: int, has_tail: bool, wire, narrow: bool, axis_name):
    """The kernel over `n_tiles` full tiles of the flat input (and one padded tail tile).

    Outputs, in order: [[mine] recv] [[mine_tail] recv_tail]: the main part when
    there are full tiles, the tail when there is one; `mine` (this device's copy
    rounded to the wire) only when the cast can round.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from jaxopt_train.kernels.mosaic_gpu import kernel_io_kwargs  # noqa: PLC0415

    per_cta = -(-n_tiles // grid) if n_tiles else 0
    per_segment = 2 if narrow else 1

    def kernel(*refs):
        x_ref = refs[0]
        tail_ref = refs[1] if has_tail else None
        outs = refs[1 + has_tail:-1]
        sem_ref = refs[-1]
        split = per_segment if n_tiles else 0
        main_outs, tail_outs = outs[:split], outs[split:]
        cta = lax.axis_index("cta")
        peer = {axis_name: 1 - lax.axis_index(axis_name)}

        def send(src, dst_outs, span):
            value = src[span].astype(wire)
            if narrow:
                dst_outs[0][span] = value
            plgpu.remote_ref(dst_outs[-1].at[span], peer)[...] = value

        if per_cta:
            @pl.loop(0, per_cta)
            def _tile(i):
                t = i * grid + cta  # neighbouring CTAs take neighbouring tiles

                @pl.when(t < n_tiles)
                def _():
                    send(x_ref, main_outs, pl.ds(t * tile, tile))

        if has_tail:
            @pl.when(cta == grid - 1)
            def _():
                send(tail_ref, tail_outs, slice(None))

        # The signal is released after this CTA's stores; the wait is for the peer's.
        pl.semaphore_signal(sem_ref.at[cta], 1, device_id=peer)
        pl.semaphore_wait(sem_ref.at[cta], 1)

    shapes = [jax.ShapeDtypeStruct((n_tiles * tile,), wire)] * per_segment if n_tiles else []
    if has_tail:
        shapes += [jax.ShapeDtypeStruct((tile,), wire)] * per_segment
    return plgpu.kernel(kernel, grid=(grid,), grid_names=("cta",),
                        **kernel_io_kwargs(plgpu, tuple(shapes), [plgpu.SemaphoreType.REGULAR((grid,))]))


def peer_all_reduce(x, axis_name: AxisName, *, wire_dtype=None, tile: int = DEFAULT_TILE,
                    ctas_per_sm: int = DEFAULT_CTAS_PER_SM, return_wire_copy: bool = False):
    """Sums `x` over a 2-device mesh axis with one peer-store kernel; equals `lax.psum` up to the wire.

    Call inside `jax.shard_map` (outputs vary over the axis: `out_specs=P(axis)`
    or `check_vma=False`). Semantics are those of the ppermute exchange
    (`ring_all_reduce` on 2 devices): each device's contribution is rounded
    through `wire_dtype`, the two are added in the accumulation dtype (f32 for
    inputs narrower than 32 bits) and the sum is rounded once to `x.dtype`, so
    both devices hold bit-identical results.

    Args:
      x: this device's array, float16 / bfloat16 / float32, any shape and size.
      axis_name: a `jax.shard_map` mesh axis of 2 devices.
      wire_dtype: dtype sent over the link (default `x.dtype`).
      tile: elements per CTA step (power of two >= 512).
      ctas_per_sm: CTAs launched per SM.
      return_wire_copy: also return this device's contribution as added (its
        rounding through the wire, in f32), for compression's error feedback.

    Returns:
      The sum, with `x`'s shape and dtype; with `return_wire_copy`, the pair
      (sum, flat f32 wire copy).
    """
    _check_axis(axis_name)
    x_dtype, wire = _check_dtypes(x.dtype, wire_dtype)
    _check_config(tile, ctas_per_sm)
    check_platform()
    accum = accumulation_dtype(x_dtype)
    # A cast can round unless it widens: f16 <-> bf16 rounds at equal width (mantissa one way,
    # exponent range the other), and then the peer must add this device's rounded copy too.
    narrow = wire != x_dtype and wire.itemsize <= x_dtype.itemsize
    flat = x.reshape(-1)
    n = flat.size
    if n == 0:  # no tile to send: a kernel with no outputs, and nothing to add
        empty = x.astype(x_dtype)
        return (empty, jnp.zeros((0,), jnp.float32)) if return_wire_copy else empty
    n_tiles, tail = divmod(n, tile)
    from jaxopt_train.kernels.mosaic_gpu import num_sms  # noqa: PLC0415

    grid = max(1, min(n_tiles, ctas_per_sm * num_sms()))
    operands = [flat]
    if tail:  # the last partial tile travels zero-padded in its own small buffer
        operands.append(jnp.pad(flat[n_tiles * tile:], (0, tile - tail)))
    outs = list(_kernel_call(n_tiles, tile, grid, bool(tail), wire, narrow, axis_name)(*operands))

    def add(source):
        mine = outs.pop(0) if narrow else source
        theirs = outs.pop(0)
        own = mine.astype(accum)
        return own + theirs.astype(accum), own

    pieces, owns = [], []
    if n_tiles:
        total, own = add(flat[: n_tiles * tile])
        pieces.append(total)
        owns.append(own)
    if tail:
        total, own = add(operands[-1])
        pieces.append(total[:tail])
        owns.append(own[:tail])
    summed = (pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)).astype(x_dtype).reshape(x.shape)
    if not return_wire_copy:
        return summed
    copy = owns[0] if len(owns) == 1 else jnp.concatenate(owns)
    return summed, copy.astype(jnp.float32)
