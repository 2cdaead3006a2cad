"""Compressed all-reduce with error feedback: bf16 or int8 on the wire, f32 sums.

Scheme (per flat bucket of N elements on n devices, as in ZeRO++'s qgZ):

1. `v = g + e` (the gradient plus this device's carried error), split into n chunks;
2. each chunk is encoded (bf16 cast, or int8 with one f32 scale per block of
   `INT8_BLOCK` elements) and chunk i is sent to device i (all-to-all:
   `lax.all_to_all` for method "psum", direct `ppermute` shifts otherwise);
3. device i decodes the n copies of chunk i and sums them in f32;
4. the sum is encoded once more and all-gathered, and every device decodes
   the same bytes, so all replicas stay bit-identical.

On 2 devices with a ring (every method but "psum") it is one exchange
instead, as `ring_all_reduce` does there: each device encodes its whole
`v`, sends it to the other, and both add the same two decoded copies in f32
(bit-identical, one encoding per device, no re-encoding of the sum). On an
axis of 1 device nothing travels and nothing is encoded: the result is exact.

Error feedback: the encoding error of step 2 stays on its device, and the
error of step 4 is added to the owner's error at that chunk, so the next step
re-sends exactly what was lost (on the 2-device exchange the error is only
what this device's encoding lost). Summed over T steps the delivered reductions
equal the true sums minus the errors still held after the last step (for f32
leaves: `all_reduce_tree` then rounds a narrower leaf's f32 sum to the leaf's
dtype, as `lax.psum` in that dtype rounds, and that last rounding is not fed back).

Error bound, per element of one result (before feedback), with block scale
`s = max(max|block| / 127, 2**-126)` for int8 (floored at the smallest normal
f32, which a block of values under ~1.5e-36 is quantised in steps of):

    |result - sum_j v_j| <= sum_j s_j / 2 + s_sum / 2

where s_j is the scale of device j's block holding the element and s_sum that
of the summed block; i.e. at most (n + 1)/2 quantisation steps of the largest
block (the 2-device exchange drops the s_sum / 2 term). For bf16 (8
significant bits, unit roundoff 2**-8) the bound is
`2**-8 * (sum_j |v_j| + |sum_j v_j|)`. With feedback the accumulated error over
any number of steps stays within one step's bound.

Non-finite input: an inf or NaN anywhere in a block makes that block of the
result non-finite (inf or NaN for bf16, NaN for int8), as with `lax.psum`, and
the block's new error is NaN too. Discard the new error state on such a step
and keep the previous one (as `train.step` does with `all_finite`), or the
NaN is re-sent on every later step.

Finite but past bf16's range: an f32 element with |x| of about 3.396e38 or more
(bf16's largest finite value, 3.3895e38, plus half its last step) rounds to inf
under the bf16 codec, so the bound above does
not hold for it and the result reads as non-finite, as an overflow would (the
train step skips such a step). int8 keeps it finite: its scale is an f32.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxopt_train._checks import is_int
from jaxopt_train._typed_sharding import to_varying
from jaxopt_train.collectives.peer import peer_all_reduce
from jaxopt_train.collectives.ring import _Ring, all_gather_chunks, all_reduce_rings, single_ring, wire_cast

CODECS = ("bf16", "int8")
INT8_BLOCK = 256


class ErrorFeedbackState(NamedTuple):
    """Per-device compression errors, an f32 pytree shaped like the gradients.

    Every device holds its own; inside `jax.shard_map` store it with a leading
    device axis sharded over the data axis (see `init_error_feedback`).
    """

    error: Any


def init_error_feedback(params: Any, num_replicas: int | None = None) -> ErrorFeedbackState:
    """Zero errors shaped like `params` (f32), with a leading `num_replicas` axis if given.

    Args:
      params: the pytree whose gradients will be reduced.
      num_replicas: if set, each leaf gets a leading axis of this size, to be
        sharded `P("data")` and passed to `jax.shard_map` (each device then sees
        a leading axis of 1, which `all_reduce_tree` accepts).

    Raises:
      ValueError: if `num_replicas` is not None or a positive int.
    """
    # int() would truncate 2.5 to 2 and turn "8" or True into a size: a wrong
    # leading axis only fails later, inside jax.shard_map, far from the cause.
    if num_replicas is not None and (not is_int(num_replicas) or num_replicas < 1):
        raise ValueError(f"{num_replicas=} must be None or a positive int (the number of devices of the "
                         "data axis, e.g. mesh.shape['data'])")
    lead = () if num_replicas is None else (int(num_replicas),)
    return ErrorFeedbackState(jax.tree.map(lambda p: jnp.zeros(lead + jnp.shape(p), jnp.float32), params))


def check_codec(compression: str | None) -> str | None:
    if compression is not None and compression not in CODECS:
        raise ValueError(f"{compression=} must be None or one of {CODECS}")
    return compression


def encode(x, codec: str):
    """Encodes f32 `x` [..., c] (c a multiple of INT8_BLOCK for int8) into wire arrays."""
    if codec == "bf16":  # pinned: the error feedback decodes this device's own copy
        return (wire_cast(x, jnp.bfloat16),)
    blocks = x.reshape(x.shape[:-1] + (-1, INT8_BLOCK))
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    # Floored at the smallest normal f32: below 127 * 2**-126 (~1.5e-36) amax / 127 is
    # subnormal, XLA flushes it to zero, and the whole block decoded to 0 instead of its sum.
    scale = jnp.maximum(amax / 127.0, jnp.float32(np.finfo(np.float32).tiny)).astype(jnp.float32)
    # An int8 payload cannot hold inf/NaN, and an inf scale decodes finite
    # values to NaN but its zeros to 0 * inf: the second encoding (of the sum)
    # would then lose the NaN again. A NaN scale keeps the whole block NaN
    # through every decode, so an overflow reaches the caller's finite check.
    scale = jnp.where(jnp.isfinite(amax), scale, jnp.float32(jnp.nan))
    q = jnp.clip(jnp.round(blocks / scale), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale[..., 0]


def decode(payload, codec: str):
    """Inverse of `encode`, to f32."""
    if codec == "bf16":
        return payload[0].astype(jnp.float32)
    q, scale = payload
    blocks = q.reshape(q.shape[:-1] + (-1, INT8_BLOCK)).astype(jnp.float32)
    return (blocks * scale[..., None]).reshape(q.shape)


def _exchange(payload, ring: _Ring | None, axis_name, n: int, me):
    """All-to-all of [n, ...] payload rows: returns [n, ...] where row j came from device j.

    `ring=None` uses `lax.all_to_all`; otherwise n-1 `ppermute` shifts along the ring.
    """
    if ring is None:
        return tuple(lax.all_to_all(a, axis_name, 0, 0, tiled=True) for a in payload)
    order = ring.cycles[0]
    received = []
    for a in payload:
        rows_out = jnp.zeros_like(a)
        own = lax.dynamic_index_in_dim(a, me, 0, keepdims=True)
        rows_out = lax.dynamic_update_index_in_dim(rows_out, own, me, 0)
        for shift in range(1, n):
            perm = [(order[p], order[(p + shift) % n]) for p in range(n)]
            send = lax.dynamic_index_in_dim(a, (me + shift) % n, 0, keepdims=True)
            got = lax.ppermute(send, axis_name, perm)
            rows_out = lax.dynamic_update_index_in_dim(rows_out, got, (me - shift) % n, 0)
        received.append(rows_out)
    return tuple(received)


def _gather(payload, ring: _Ring | None, axis_name, n: int):
    """All-gather of each array of `payload` (one row per device) into [n, ...]."""
    if ring is None:
        return tuple(lax.all_gather(a, axis_name, axis=0, tiled=False) for a in payload)
    return tuple(all_gather_chunks(a[None], ring, wire_dtype=a.dtype, out_dtype=a.dtype)[:, 0] for a in payload)


def _pair_exchange(v, codec: str, ring: _Ring):
    """Sum of f32 `v` over a 2-device ring as one exchange; returns (sum, this device's encoding error)."""
    size = v.size
    padded = jnp.pad(v, (0, -size % INT8_BLOCK)) if codec == "int8" else v
    sent = encode(padded, codec)
    received = tuple(lax.ppermute(a, ring.axis_name, ring.perm()) for a in sent)
    mine = decode(sent, codec)
    if codec == "bf16":  # a + b == b + a: both devices get the same bits
        return (mine + decode(received, codec))[:size], (padded - mine)[:size]
    # int8 decodes with a multiply, which the compiler may contract with the
    # addition into an FMA (q_a * s_a + d_b != q_b * s_b + d_a on CPU): put the
    # two payloads in ring-position order so both devices run the same arithmetic.
    first = ring.position() == 0
    lo = tuple(jnp.where(first, m, r) for m, r in zip(sent, received))
    hi = tuple(jnp.where(first, r, m) for m, r in zip(sent, received))
    return (decode(lo, codec) + decode(hi, codec))[:size], (padded - mine)[:size]


def compressed_all_reduce(flat, axis_name, n: int, *, codec: str, ring: _Ring | None, error=None,
                          peer: bool = False):
    """Sums the 1-D `flat` over `axis_name` through `codec`; returns (sum f32, new error or None).

    Args:
      flat: this device's vector (any floating dtype; computed in f32).
      axis_name: the mapped axis, of size `n`.
      codec: "bf16" or "int8".
      ring: ring whose order the ppermute exchange follows, or None for
        `lax.all_to_all` / `lax.all_gather`. A ring of 2 devices makes the
        reduction one exchange of the whole encoded vector.
      error: this device's carried error, f32, `flat`'s shape (or None: no feedback).
      peer: exchange through `peer.peer_all_reduce` (2 devices, bf16 only)
        instead of a ppermute; same sums and errors as the ring exchange.

    On an axis of one device nothing is encoded: the sum is `flat + error`
    exactly (as `lax.psum`, in `flat`'s dtype when wider than f32) and the new
    error is zero.

    Differentiable straight through: the gradient is that of the exact sum.
    (Rounding has a zero derivative, so autodiff through the codec gave 0 for
    every element but each int8 block's largest, and a wrong value there.)
    """
    if n == 1 and not peer:  # nothing travels: encoding would only lose precision that lax.psum keeps
        wide = flat.dtype if np.dtype(flat.dtype).itemsize > 4 else np.dtype(np.float32)
        total = flat.astype(wide) if error is None else flat.astype(wide) + error.reshape(-1).astype(wide)
        # zeros_like keeps the error's type varying over the axis, as on n > 1: a fresh
        # jnp.zeros is typed invariant, and lax.scan (check_vma on) then refused the carry.
        return total, None if error is None else jnp.zeros_like(error, jnp.float32)
    v = flat.astype(jnp.float32)
    if error is not None:
        v = v + error.reshape(-1)
    # The backward's ring returns a cotangent typed varying over the axis, and a custom_vjp
    # must return its input's type: a replicated (invariant) `v` failed to differentiate
    # under check_vma with "the manual axis types do not match".
    v = to_varying(v, (axis_name,))
    reduce = functools.partial(_compressed_sum, axis_name=axis_name, n=n, codec=codec, ring=ring,
                               error_shape=None if error is None else error.shape, peer=peer)
    return _straight_through(reduce, axis_name)(v)


def _straight_through(reduce, axis_name):
    """`reduce` (v -> (sum, new error)) whose derivative is that of the exact sum over
    `axis_name`: the cotangent of the sum, summed over the axis (by a ring, so it is
    typed varying like `v`); the new error passes no gradient."""
    @jax.custom_vjp
    def run(v):
        return reduce(v)

    def backward(_, cotangents):
        return (all_reduce_rings(cotangents[0], [single_ring(axis_name)]),)

    run.defvjp(lambda v: (reduce(v), None), backward)
    return run


def _compressed_sum(v, *, axis_name, n: int, codec: str, ring: _Ring | None, error_shape, peer: bool):
    """`compressed_all_reduce` of f32 `v` (error already added); the new error has `error_shape`
    (None: no feedback)."""
    size = v.size
    if peer:
        if codec != "bf16":
            raise ValueError(f"the peer exchange compresses to bf16 only; got codec={codec!r}")
        result, sent = peer_all_reduce(v, axis_name, wire_dtype=jnp.bfloat16, return_wire_copy=True)
        return result, None if error_shape is None else (v - sent).reshape(error_shape)
    if ring is not None and ring.size == 2:
        result, local_error = _pair_exchange(v, codec, ring)
        return result, None if error_shape is None else local_error.reshape(error_shape)
    per = n * (INT8_BLOCK if codec == "int8" else 1)
    chunks = jnp.pad(v, (0, -size % per)).reshape(n, -1)
    me = lax.axis_index(axis_name) if ring is None else ring.position()
    sent = encode(chunks, codec)
    received = _exchange(sent, ring, axis_name, n, me)
    shard = jnp.sum(decode(received, codec), axis=0)
    packed = encode(shard, codec)
    result = decode(_gather(packed, ring, axis_name, n), codec).reshape(-1)[:size]
    if error_shape is None:
        return result, None
    local_error = chunks - decode(sent, codec)
    shard_error = shard - decode(packed, codec)
    mine = lax.dynamic_index_in_dim(local_error, me, 0, keepdims=False) + shard_error
    new_error = lax.dynamic_update_index_in_dim(local_error, mine, me, 0)
    return result, new_error.reshape(-1)[:size].reshape(error_shape)
