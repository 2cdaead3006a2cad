"""Synthetic batches for benchmarks: right shapes and dtypes, no I/O.

They are host numpy arrays like every other dataset's batches, so the
benchmark pays the same `shard_batch` transfer as real training.
"""

from __future__ import annotations

import numpy as np

from jaxopt_train.data.sampling import check_positive_int, check_seed


def synthetic_lm_batch(
    batch_size: int, seq_len: int, vocab_size: int, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """Uniform random tokens as ``{"inputs", "targets"}`` int32 [B, T], targets shifted by one."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        check_positive_int(name, value)
    check_seed(seed)
    window = np.random.default_rng(seed).integers(0, vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def synthetic_image_batch(
    batch_size: int,
    *,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random ``{"images": float32 [B, S, S, C] in [0, 1), "labels": int32 [B]}``."""
    for name, value in (
        ("batch_size", batch_size), ("image_size", image_size),
        ("channels", channels), ("num_classes", num_classes),
    ):
        check_positive_int(name, value)
    check_seed(seed)
    rng = np.random.default_rng(seed)
    images = rng.random((batch_size, image_size, image_size, channels), dtype=np.float32)
    labels = rng.integers(0, num_classes, (batch_size,), dtype=np.int32)
    return {"images": images, "labels": labels}
