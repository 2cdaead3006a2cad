"""Gradient buckets: leaves packed into flat vectors of about `bucket_mb`, last layer first.

Leaves are walked in reverse pytree order (the reverse of layer order for a
model whose parameters are declared input to output), so the first buckets
hold the gradients that backward finishes first and their reductions can run
while earlier layers are still differentiating. The first bucket is small so
communication starts as early as possible. Leaves are never split and each
bucket holds one dtype, so bucketing changes only which elements are summed
together in one collective, never the per-element sum.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat vector to reduce.

    Attributes:
      leaf_indices: indices into the flattened leaves, in packing order.
      dtype: the common dtype of those leaves.
      sizes: element count of each leaf, in the same order.
    """

    leaf_indices: tuple[int, ...]
    dtype: np.dtype
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes) * self.dtype.itemsize


def _check_mb(name: str, value) -> float:
    """`value` as a float number of MiB >= 0 (inf allowed), or a TypeError/ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number of MiB (int or float), not {type(value).__name__}")
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"{name}={value!r} must be >= 0 MiB (0: one leaf per bucket, math.inf: no limit)")
    return float(value)


def plan_buckets(leaves: Sequence, bucket_mb: float, first_bucket_mb: float | None = None) -> list[Bucket]:
    """Groups leaves (anything with `.shape` and `.dtype`) into buckets, in reverse leaf order.

    Args:
      leaves: flattened pytree leaves.
      bucket_mb: target bucket size in MiB; a bucket closes before a leaf that
        would push it past this (a larger leaf gets a bucket of its own).
        `0` puts each leaf in its own bucket; `math.inf` one bucket per dtype.
      first_bucket_mb: cap of the first bucket of each dtype (default
        `min(1, bucket_mb)`, so the first reduction starts early; with
        `bucket_mb=math.inf` the default is no cap, keeping one bucket per dtype).

    Returns:
      Buckets in the order their reductions should be issued.
    """
    bucket_mb = _check_mb("bucket_mb", bucket_mb)
    if first_bucket_mb is not None:
        first = _check_mb("first_bucket_mb", first_bucket_mb)
    else:  # inf asks for one bucket per dtype: a small first bucket would split it
        first = bucket_mb if math.isinf(bucket_mb) else min(1.0, bucket_mb)
    done: list[Bucket] = []
    open_: dict[np.dtype, list[int]] = {}
    opened_before: set[np.dtype] = set()

    def close(dtype):
        indices = open_.pop(dtype)
        done.append(Bucket(tuple(indices), dtype, tuple(math.prod(leaves[i].shape) for i in indices)))
        opened_before.add(dtype)

    for index in reversed(range(len(leaves))):
        leaf = leaves[index]
        dtype = np.dtype(leaf.dtype)
        nbytes = math.prod(leaf.shape) * dtype.itemsize
        cap = (bucket_mb if dtype in opened_before else first) * MIB
        current = open_.get(dtype)
        if current:
            used = sum(math.prod(leaves[i].shape) for i in current) * dtype.itemsize
            if used + nbytes > cap:
                close(dtype)
                cap = bucket_mb * MIB
        open_.setdefault(dtype, []).append(index)
        if nbytes >= cap:
            close(dtype)
    # Still-open buckets are issued in the order their first (last-layer) leaf becomes ready.
    for dtype in sorted(open_, key=lambda d: -open_[d][0]):
        close(dtype)
    return done


def pack(bucket: Bucket, leaves: Sequence):
    """The bucket's leaves raveled and concatenated into one flat vector."""
    return jnp.concatenate([jnp.ravel(leaves[i]) for i in bucket.leaf_indices])


def unpack(bucket: Bucket, flat, leaves: Sequence, out: list) -> None:
    """Splits `flat` back into leaves shaped like `leaves`, written into `out` at their indices."""
    offset = 0
    for index, size in zip(bucket.leaf_indices, bucket.sizes):
        out[index] = flat[offset: offset + size].reshape(leaves[index].shape)
        offset += size
