"""Ring reduce-scatter, all-gather and all-reduce built from `lax.ppermute` steps.

A ring of m devices moves a message of N elements in 2(m-1) steps of N/m
elements each (reduce-scatter then all-gather), so every link carries
2(m-1)/m of the message: the bandwidth-optimal schedule that NCCL also uses.

Two things make these rings fast rather than naive:

* Chunk pipelining (`num_chunks`): the data is split into `num_chunks`
  independent rings, so the transfer of one piece can overlap the addition of
  another instead of alternating send / add / send. On 2 H200s (jax 0.11.2)
  XLA ran the pieces' permutes and adds one after another and every extra
  piece cost a synchronised NCCL call, so `num_chunks > 1` was slower there
  (BENCHMARKS.md) and the default is 1.
* Bidirectional rings (`bidirectional=True`): half of the data goes round the
  ring one way and half the other way, using both directions of every link.

On 2 devices the all-reduce is one exchange instead (`exchange_all_reduce`):
each device sends its whole buffer to the other and adds. That moves the same
bytes per link direction as reduce-scatter + all-gather (N each way) but in one
transfer with no dependent second phase; on 2 H200s it reached 0.96-1.02x
`lax.psum` (f32, 256 MiB-1 GiB) where reduce-scatter + all-gather reached
0.83-0.91x (tools/probe_dp.py, phase B).

Accumulation is in f32 for inputs narrower than 32 bits, whatever goes on the
wire: a partial sum is rounded to `wire_dtype` only while it travels. Where a
device also uses its own rounded copy (the exchange's add, the all-gather's own
row), `wire_cast` pins that copy, or XLA's GPU compiler would fold the
f32 -> bf16 -> f32 pair away there and leave the replicas differing.
Differentiated, a ring's backward is the same ring transposed, so a narrow
`wire_dtype` rounds the cotangents in flight as well, as it rounds the
forward partial sums; the compressed all-reduce (compression.py)
instead passes the exact sum's gradient through. A ring's result is typed
varying over the axis (a psum's is not), so under `check_vma` the derivative
with respect to a replicated (invariant) input counts every device's copy of
the result: n times what `lax.psum` gives. For per-device inputs (gradients)
the two derivatives agree.

The ring primitives work on a `_Ring` (an axis name plus one or more disjoint
cycles of axis indices), which is how the hierarchical all-reduce runs rings
inside and across groups of one mesh axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxopt_train._checks import is_int
from jaxopt_train.collectives._axis import AxisName, axis_names, axis_size, check_ring_order


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Disjoint cycles of equal length over the indices of one mapped axis.

    Attributes:
      axis_name: the mapped axis whose indices `cycles` lists.
      cycles: each tuple is one ring, in the order data travels round it.
    """

    axis_name: AxisName
    cycles: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.cycles[0])

    def reversed(self) -> _Ring:
        return _Ring(self.axis_name, tuple(tuple(reversed(c)) for c in self.cycles))

    def perm(self) -> list[tuple[int, int]]:
        m = self.size
        return [(c[i], c[(i + 1) % m]) for c in self.cycles for i in range(m)]

    def position(self):
        """This device's (traced) position in its cycle."""
        table = np.zeros(sum(len(c) for c in self.cycles), np.int32)
        for cycle in self.cycles:
            for pos, index in enumerate(cycle):
                table[index] = pos
        return jnp.asarray(table)[lax.axis_index(self.axis_name)]


def single_ring(axis_name: AxisName, ring_order: Sequence[int] | None = None) -> _Ring:
    """The one ring over all of `axis_name` (one axis), in `ring_order` (default: axis index order).

    A 1-tuple names its one axis. Longer tuples are refused: `lax.ppermute`
    over several axes numbers devices in mesh order while `lax.axis_index`
    numbers them in the tuple's order, so one ring over them would mix the two.
    """
    names = axis_names(axis_name)
    if len(names) != 1:
        raise ValueError(f"a ring runs over one mesh axis; got {axis_name=} (reduce a tuple of axes "
                         "with ring_all_reduce / ring_reduce_scatter, which run one ring per axis)")
    return _Ring(names[0], (check_ring_order(ring_order, axis_size(names[0])),))


def axis_rings(axis_name: AxisName, ring_order: Sequence[int] | None = None) -> list[_Ring]:
    """One ring per axis of `axis_name` (a name or a tuple, major axis first), as `lax.psum` reads it."""
    names = axis_names(axis_name)
    if len(names) > 1 and ring_order is not None:
        raise ValueError(f"ring_order= orders the devices of one axis; got {ring_order=} with {axis_name=} "
                         "(a tuple of axes is reduced one ring per axis, each in index order)")
    return [single_ring(names[0], ring_order)] if len(names) == 1 else [single_ring(a) for a in names]


def accumulation_dtype(dtype) -> np.dtype:
    """f32 for floating dtypes narrower than 32 bits, else the dtype itself."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(jnp.float32)
    return dtype


def wire_cast(x, dtype):
    """`x` rounded to `dtype` and kept as a `dtype` array, for data that is sent AND used locally.

    XLA's GPU compiler removes convert pairs such as f32 -> bf16 -> f32
    (SimplifyFPConversions, on while `xla_allow_excess_precision` is true, the
    default). A device that widens its own wire copy again would then keep the
    unrounded value while its peer receives the rounded one, and the replicas'
    "identical" sums would differ (seen on 2 H200s: tools/probe_wire.py). The
    optimization barrier keeps the narrow array, which is also the cheaper one
    to re-read (2 bytes an element instead of 4). A no-op cast stays a no-op.
    """
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    out = x.astype(dtype)
    # Only a cast that can round needs the pin (widening is exact).
    if (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)
            and dtype.itemsize <= np.dtype(x.dtype).itemsize):
        out = lax.optimization_barrier(out)
    return out


def _take(chunks, label, label_to_chunk):
    """Row `label_to_chunk[label]` of `chunks` ([m, c]), `label` traced."""
    index = label if label_to_chunk is None else jnp.asarray(label_to_chunk)[label]
    return lax.dynamic_index_in_dim(chunks, index, axis=0, keepdims=False)


def reduce_scatter_pieces(pieces, ring: _Ring, *, wire_dtype, accum_dtype, label_to_chunk=None):
    """Ring reduce-scatter of each piece [m, c] independently; returns this device's sums ([c] each).

    The device at ring position p ends with the sum of row `label_to_chunk[p]`
    (row p when None) of every piece, in `accum_dtype`. The pieces are
    independent rings emitted step by step, so XLA can overlap the transfer of
    one piece with the addition of another (chunk pipelining).
    """
    m, perm = ring.size, ring.perm()
    pos = ring.position()
    own = lambda piece, label: _take(piece, label % m, label_to_chunk).astype(accum_dtype)  # noqa: E731
    accs = [own(piece, pos - 1) for piece in pieces]
    for step in range(m - 1):
        received = [lax.ppermute(acc.astype(wire_dtype), ring.axis_name, perm) for acc in accs]
        accs = [r.astype(accum_dtype) + own(piece, pos - step - 2) for r, piece in zip(received, pieces)]
    return accs


def all_gather_pieces(shards, ring: _Ring, *, wire_dtype, out_dtype, label_to_chunk=None,
                      piece_major: bool = True, out=None, first: int = 0):
    """Ring all-gather of each shard [c] (held at ring position p as row `label_to_chunk[p]`).

    Returns one buffer, [pieces, m, c] (`piece_major`) or [m, pieces, c], in
    `out_dtype`, written in place as the rows arrive (into `out` from piece
    `first` on, when given). Every device rounds its own shard through
    `wire_dtype` too, so all devices end bit-identical.
    """
    m, perm = ring.size, ring.perm()
    pos = ring.position()
    count, width = len(shards), shards[0].shape[0]
    index = lambda label: label % m if label_to_chunk is None else jnp.asarray(label_to_chunk)[label % m]  # noqa: E731
    if out is None:
        out = jnp.zeros((count, m, width) if piece_major else (m, count, width), out_dtype)
    zero = jnp.zeros((), jnp.int32)

    def write(out, value, k, label):
        row = index(label).astype(jnp.int32)
        start = (jnp.int32(k), row, zero) if piece_major else (row, jnp.int32(k), zero)
        return lax.dynamic_update_slice(out, value.astype(out_dtype)[None, None], start)

    current = [wire_cast(shard, wire_dtype) for shard in shards]  # this device's row, too
    for k, value in enumerate(current):
        out = write(out, value, first + k, pos)
    for step in range(m - 1):
        current = [lax.ppermute(value, ring.axis_name, perm) for value in current]
        for k, value in enumerate(current):
            out = write(out, value, first + k, pos - step - 1)
    return out


def all_gather_chunks(shard, ring: _Ring, *, wire_dtype, out_dtype):
    """All-gather of one [1, c] shard into [m, 1, c] rows in ring-position order (used by compression)."""
    return all_gather_pieces([shard[0]], ring, wire_dtype=wire_dtype, out_dtype=out_dtype, piece_major=False)


def _check_array(x, what: str):
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(f"{what} needs a jax or numpy array; got {type(x).__name__}")


def _check_floating_or_int(x, what: str):
    _check_array(x, what)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{what} needs a floating or integer array; got dtype={x.dtype}")


def _wire_dtype(x, wire_dtype) -> np.dtype:
    """The wire dtype for `x` (`x.dtype` when None), refused where a cast would silently corrupt.

    Floating data travels in any floating dtype (a narrower one rounds, by
    design). Integer data travels only in an integer dtype at least as wide:
    partial sums in a narrower integer would wrap, and in a float would round.
    """
    if wire_dtype is None:
        return np.dtype(x.dtype)
    try:
        wire = np.dtype(wire_dtype)
    except TypeError as err:
        raise TypeError(f"wire_dtype={wire_dtype!r} is not a dtype") from err
    if jnp.issubdtype(x.dtype, jnp.floating):
        if not jnp.issubdtype(wire, jnp.floating):
            raise TypeError(f"wire_dtype={wire} cannot carry {x.dtype} data; expected a floating dtype "
                            "(for int8 on the wire use all_reduce_tree(compression='int8'), which sends scales)")
    elif not (jnp.issubdtype(wire, jnp.integer) and wire.itemsize >= np.dtype(x.dtype).itemsize):
        raise TypeError(f"wire_dtype={wire} cannot carry {x.dtype} partial sums without wrapping or "
                        f"rounding; expected an integer dtype at least as wide as {x.dtype}")
    return wire


def _check_num_chunks(num_chunks: int) -> int:
    if not is_int(num_chunks) or num_chunks < 1:
        raise ValueError(f"{num_chunks=} must be a positive int (pieces per shard for pipelining)")
    return int(num_chunks)


def ring_reduce_scatter(x, axis_name: AxisName, *, ring_order: Sequence[int] | None = None,
                        wire_dtype=None, num_chunks: int = 1):
    """Sums `x` over `axis_name` and scatters dimension 0: device i gets rows block i.

    Equal (up to summation order) to
    `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`.

    Args:
      x: this device's array; `x.shape[0]` must be divisible by the axis size.
      axis_name: mapped axis (from `jax.shard_map` or `jax.pmap`), or a tuple
        of them: one ring per axis, major axis first, as `lax.psum_scatter`
        numbers the devices.
      ring_order: axis indices in the order data travels; default `0..n-1`
        (one axis only).
      wire_dtype: dtype of partial sums in flight (default `x.dtype`); sums are
        accumulated in f32 for inputs narrower than 32 bits. Same rules as
        `ring_all_reduce`'s.
      num_chunks: independent pipelined rings per shard.

    Returns:
      Array of shape `(x.shape[0] // n, *x.shape[1:])` and dtype `x.dtype`.
    """
    rings = axis_rings(axis_name, ring_order)
    n = math.prod(ring.size for ring in rings)
    _check_floating_or_int(x, "ring_reduce_scatter")
    if x.ndim == 0:
        raise ValueError(f"ring_reduce_scatter needs an array with a dimension 0 to scatter; got {x.shape=}")
    if x.shape[0] % n:
        raise ValueError(
            f"ring_reduce_scatter needs {x.shape[0]=} divisible by the size {n} of axis {axis_name!r}; "
            "pad dimension 0 or use ring_all_reduce"
        )
    count = _check_num_chunks(num_chunks)
    wire = _wire_dtype(x, wire_dtype)
    # Between the axes of a tuple the partial sums stay in the accumulation dtype.
    partial = x
    for ring in rings[:-1]:
        partial = _reduce_scatter_one(partial, ring, wire=wire, count=count, out_dtype=accumulation_dtype(x.dtype))
    return _reduce_scatter_one(partial, rings[-1], wire=wire, count=count, out_dtype=x.dtype)


def _reduce_scatter_one(x, ring: _Ring, *, wire, count: int, out_dtype):
    """`ring_reduce_scatter` over one ring, its result in `out_dtype`."""
    n = ring.size
    rows = x.reshape(n, -1)
    per_row = rows.shape[1]
    rows = jnp.pad(rows, ((0, 0), (0, -per_row % count)))
    width = rows.shape[1] // count
    pieces = [rows[:, k * width:(k + 1) * width] for k in range(count)]
    shards = reduce_scatter_pieces(pieces, ring, wire_dtype=wire, accum_dtype=accumulation_dtype(x.dtype),
                                   label_to_chunk=ring.cycles[0])
    shard = shards[0] if count == 1 else jnp.concatenate(shards)
    return shard[:per_row].astype(out_dtype).reshape((x.shape[0] // n,) + x.shape[1:])


def ring_all_gather(x, axis_name: AxisName, *, ring_order: Sequence[int] | None = None, num_chunks: int = 1):
    """Concatenates every device's `x` along dimension 0, in axis index order.

    Equal to `lax.all_gather(x, axis_name, axis=0, tiled=True)` (bit for bit:
    nothing is added).

    Args:
      x: this device's array, rank >= 1.
      axis_name: mapped axis (from `jax.shard_map` or `jax.pmap`), or a tuple
        of them (one ring per axis, major axis first, as in `lax.all_gather`).
      ring_order: axis indices in the order data travels; default `0..n-1`
        (one axis only).
      num_chunks: independent pipelined rings.

    Returns:
      Array of shape `(n * x.shape[0], *x.shape[1:])`.
    """
    rings = axis_rings(axis_name, ring_order)
    _check_array(x, "ring_all_gather")
    if x.ndim == 0:
        raise ValueError(f"ring_all_gather needs an array with a dimension 0 to concatenate; got {x.shape=}")
    count = _check_num_chunks(num_chunks)
    for ring in reversed(rings):  # the minor axis first: its blocks end up innermost
        x = _all_gather_one(x, ring, count)
    return x


def _all_gather_one(x, ring: _Ring, count: int):
    """`ring_all_gather` over one ring."""
    n = ring.size
    flat = x.reshape(-1)
    shards = list(jnp.pad(flat, (0, -flat.size % count)).reshape(count, -1))
    gathered = all_gather_pieces(shards, ring, wire_dtype=x.dtype, out_dtype=x.dtype,
                                 label_to_chunk=ring.cycles[0], piece_major=False)
    return gathered.reshape(n, -1)[:, : flat.size].reshape((n * x.shape[0],) + x.shape[1:])


def exchange_all_reduce(x, ring: _Ring, *, wire_dtype=None, num_chunks: int = 1):
    """All-reduce over a ring of 2 devices as ONE exchange: each sends its whole buffer and adds.

    Both devices round their own contribution through `wire_dtype` as well,
    so both add the same two values in the accumulation dtype (f32 for inputs
    narrower than 32 bits); addition is commutative, so the results are bit
    identical on the two devices. The sum is rounded once, to `x.dtype`.
    A single exchange already uses both directions of the link, so there is no
    bidirectional variant. `num_chunks > 1` splits the flat data into that many
    contiguous pieces, each its own exchange (slower on 2 H200s; kept as the
    pipelining knob of the rings).

    Args:
      x: this device's array (floating or integer), any shape.
      ring: a `_Ring` of size 2 (one or more disjoint pairs over one axis).
      wire_dtype: dtype on the wire (default `x.dtype`).
      num_chunks: independent exchanges over contiguous pieces of the flat data.

    Returns:
      The sum over the pair, with `x`'s shape and dtype.
    """
    if ring.size != 2:
        raise ValueError(f"exchange_all_reduce needs a ring of 2 devices; got ring.size={ring.size} "
                         f"(use all_reduce_rings)")
    accum = accumulation_dtype(x.dtype)
    wire = _wire_dtype(x, wire_dtype)
    count = _check_num_chunks(num_chunks)
    perm = ring.perm()
    flat = x.reshape(-1)
    pieces = [flat] if count == 1 else list(jnp.pad(flat, (0, -flat.size % count)).reshape(count, -1))
    sums = []
    for piece in pieces:
        mine = wire_cast(piece, wire)
        theirs = lax.ppermute(mine, ring.axis_name, perm)
        sums.append((mine.astype(accum) + theirs.astype(accum)).astype(x.dtype))
    out = sums[0] if count == 1 else jnp.concatenate(sums)[: flat.size]
    return out.reshape(x.shape)


def all_reduce_rings(x, rings: Sequence[_Ring], *, wire_dtype=None, num_chunks: int = 1,
                     bidirectional: bool = False):
    """All-reduce of `x` over one or more nested rings; the engine of the public all-reduces.

    With one ring this is reduce-scatter + all-gather. With several (inner,
    ..., outer) the shard left by each reduce-scatter is reduced by the next
    ring, and all-gathers run back out in reverse order: the hierarchical
    scheme. Sums stay in the accumulation dtype between stages. The flat data
    is zero-padded and split into `num_chunks` contiguous pieces (twice that
    when `bidirectional`, the second half going round the reversed rings),
    each reduced by its own pipelined ring; the last all-gather writes every
    piece straight into the one output buffer.

    Rings of one device are no-ops and are skipped; when what remains is a
    single ring of 2 devices the all-reduce is `exchange_all_reduce` (one
    exchange, which uses both link directions, so `bidirectional` changes
    nothing there).
    """
    _check_floating_or_int(x, "the ring all-reduce")
    active = [r for r in rings if r.size > 1]
    if not active:  # nothing travels: a wire rounding here would lose what lax.psum keeps
        _wire_dtype(x, wire_dtype)
        _check_num_chunks(num_chunks)
        return jnp.asarray(x)
    if len(active) == 1 and active[0].size == 2:
        return exchange_all_reduce(x, active[0], wire_dtype=wire_dtype, num_chunks=num_chunks)
    accum = accumulation_dtype(x.dtype)
    wire = _wire_dtype(x, wire_dtype)
    per_direction = _check_num_chunks(num_chunks)
    directions = [list(rings)] + ([[r.reversed() for r in rings]] if bidirectional else [])
    count = per_direction * len(directions)
    flat = x.reshape(-1)
    blocks = jnp.pad(flat, (0, -flat.size % (math.prod(r.size for r in rings) * count))).reshape(count, -1)
    groups = [[blocks[d * per_direction + k] for k in range(per_direction)] for d in range(len(directions))]
    for stage in range(len(rings)):
        groups = [reduce_scatter_pieces([p.reshape(ring_set[stage].size, -1) for p in group], ring_set[stage],
                                        wire_dtype=wire, accum_dtype=accum)
                  for group, ring_set in zip(groups, directions)]
    for stage in reversed(range(len(rings))):
        last = stage == 0
        out = None
        for d, (group, ring_set) in enumerate(zip(groups, directions)):
            if last:
                out = all_gather_pieces(group, ring_set[stage], wire_dtype=wire, out_dtype=x.dtype,
                                        out=out if out is not None else jnp.zeros(
                                            (count, ring_set[stage].size, group[0].shape[0]), x.dtype),
                                        first=d * per_direction)
            else:
                gathered = all_gather_pieces(group, ring_set[stage], wire_dtype=wire, out_dtype=accum)
                groups[d] = [gathered[k].reshape(-1) for k in range(len(group))]
    return out.reshape(-1)[: flat.size].reshape(x.shape)


def ring_all_reduce(x, axis_name: AxisName, *, bidirectional: bool = False, wire_dtype=None,
                    ring_order: Sequence[int] | None = None, num_chunks: int = 1):
    """Sums `x` over `axis_name` with a ring; equal to `lax.psum(x, axis_name)` up to summation order.

    Any shape and size works: the flattened data is zero-padded to a multiple
    of the ring size times `num_chunks` (twice that when bidirectional).
    On an axis of 2 devices it is one exchange instead (`exchange_all_reduce`):
    each device sends its whole buffer and adds, with the same bytes per link
    direction as reduce-scatter + all-gather but one transfer; the result is
    bit-identical on both devices.

    Args:
      x: this device's array (floating or integer).
      axis_name: mapped axis (from `jax.shard_map` or `jax.pmap`), or a tuple
        of them, as `lax.psum` takes (one ring per axis, nested as in
        `hierarchical_all_reduce`).
      bidirectional: run two rings in opposite directions over the two halves
        of the data, using both directions of each link. On 2 devices the
        single exchange already uses both directions: same schedule.
      wire_dtype: dtype of partial sums in flight (default `x.dtype`, as NCCL
        does). Sums accumulate in f32 for inputs narrower than 32 bits. With
        `wire_dtype=jnp.float32` a bf16 input is summed with one final rounding.
        On 2 devices each device's own contribution is rounded through the
        wire dtype too (both add the same two values), and the f32 sum is not
        rounded to the wire again. Floating data takes any floating wire; integer data
        only an integer wire at least as wide (anything else is a TypeError).
      ring_order: axis indices in the order data travels; default `0..n-1`
        (one axis only).
      num_chunks: independent pipelined rings per shard (per direction).

    Returns:
      The sum, with `x`'s shape and dtype.
    """
    rings = axis_rings(axis_name, ring_order)
    _check_floating_or_int(x, "ring_all_reduce")
    # Any truthy value ran the bidirectional rings: bidirectional="no" among them.
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"{bidirectional=} must be True or False")
    return all_reduce_rings(x, rings[::-1], wire_dtype=wire_dtype, num_chunks=num_chunks, bidirectional=bidirectional)
