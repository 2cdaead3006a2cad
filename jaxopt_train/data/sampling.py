"""Deterministic, epoch-aware batch order shared by the datasets.

Item ``i`` of the infinite stream is item ``perm_e[i % n]`` of epoch
``e = i // n``, where ``perm_e`` is a permutation drawn from ``(seed, e)``.
Batch ``step`` is stream items ``[step * B, (step + 1) * B)``: a pure function
of (seed, step, B), so a resumed run sees exactly the batches it would have
seen, and a batch may straddle two epochs instead of dropping a remainder.
"""

from __future__ import annotations

import fractions
import functools
import math

import numpy as np

from jaxopt_train._checks import is_int


def held_out_count(count: int, val_fraction) -> int:
    """floor(count * val_fraction) for a checked fraction in (0, 1), counted exactly.

    The float product rounds: 100 * 0.29 is 28.999999999999996, so int() held out 28 of
    100 where the user asked for 29. The fraction is taken as the decimal it prints as
    (0.29 -> 29/100, np.float32(0.29) too), so the count is what its digits say, for any count.

    Raises:
      ValueError: if `val_fraction` is not a real number strictly between 0 and 1.
    """
    if (isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float, np.integer, np.floating))
            or not 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction={val_fraction!r} must be a number in (0, 1), e.g. 0.1")
    # str() of the value itself, not repr(float(value)): np.float32(0.29) widened to a float is
    # 0.28999999165534973 (28 of 100 again); str() gives the shortest decimal in its own precision.
    return math.floor(int(count) * fractions.Fraction(str(val_fraction)))


def check_positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def check_seed(seed, name: str = "seed") -> None:
    """Checked when a dataset is built: numpy refuses other seeds only at the first batch."""
    if not is_int(seed) or seed < 0:
        raise ValueError(f"{name}={seed!r} must be a non-negative int")


@functools.lru_cache(maxsize=4)
def epoch_permutation(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the items in ``epoch`` (cached: consecutive steps share it).

    Kept as uint32 where the count allows (the same order): numpy draws int64, and the
    cache holds up to four epochs' orders, 6 GB each at int64 for 100B tokens in
    128-token sequences.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(num_items)
    if num_items <= np.iinfo(np.uint32).max:
        perm = perm.astype(np.uint32)
    perm.setflags(write=False)
    return perm


def batch_indices(
    step: int, batch_size: int, num_items: int, seed: int, rows: slice | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (item index, epoch) of each row of batch ``step``.

    Args:
      step: Non-negative batch number.
      batch_size: Global batch size B.
      num_items: Items per epoch.
      seed: Seed of the permutations.
      rows: Only these rows of the global batch (a process's share).
    """
    if not is_int(step) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    check_positive_int("batch_size", batch_size)
    # Python ints: numpy int32 step * batch_size wraps past 2**31 (step 2.1M at B=1024) and
    # silently repeats an earlier batch.
    step, batch_size = int(step), int(batch_size)
    stream = step * batch_size + np.arange(batch_size, dtype=np.int64)
    if rows is not None:
        if not isinstance(rows, slice) or rows.step not in (None, 1) or not (
                0 <= (rows.start or 0) <= (batch_size if rows.stop is None else rows.stop) <= batch_size):
            # Slicing past the end would quietly hand back fewer rows than asked for.
            raise ValueError(f"rows={rows!r} must be a slice start:stop with 0 <= start <= stop <= "
                             f"batch_size={batch_size}")
        stream = stream[rows]
    epochs = stream // num_items
    positions = stream % num_items
    items = np.empty_like(stream)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        items[mask] = epoch_permutation(num_items, seed, int(epoch))[positions[mask]]
    return items, epochs
