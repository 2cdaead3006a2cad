"""Data-parallel gradient of an embedding lookup, exchanged as rows instead of as a table.

The gradient of `table[ids]` is zero except in the rows the batch used, yet a
data-parallel step all-reduces it as a dense [vocab, d] table, and it is the
last gradient the backward pass finishes, so nothing can hide that reduction.
For gpt-124m that is 77 MB of bf16 per step and for gpt-1b 206 MB, against
cotangents of B*T*d elements (12.6 MB / 33.5 MB at 8 x 1024 tokens per device).

`embedding_grad_exchange` all-gathers the token ids and the lookup's output
cotangent over the data axis, then every device scatter-adds all of them
locally: the result is the summed gradient on every device, equal to
`lax.psum(local_lookup_grad)` up to summation order. A GPT with tied weights
then splits the table's gradient in two (see `bench.collectives --gpt
--gpt-embedding-exchange`): the head's part is finished at the start of the
backward and its all-reduce overlaps the rest; only the small gather is left at
the end. On 2 H200s over NVLink that cut the step's exposed reduction from 0.26 to
0.19 ms (gpt-124m, 2 layers), but the gather and scatter-add cost more compute
than that, so the step was 0.5-1% slower (BENCHMARKS.md): this is for links
that are slow relative to HBM (PCIe), not NVLink.

An id outside [0, num_embeddings) makes the whole returned gradient NaN, as the
rest of the library treats such ids (`GPT.embed` gives a NaN row, `gpt_loss` a
NaN loss or, for concrete ids, a ValueError), so the trainer's finite check
reports it. Plain `jax.grad` of `table[ids]` gives a bad batch a plausible
gradient instead (on jax 0.10 an id >= num_embeddings is dropped and a
negative id wraps round to a real row); for in-range ids the two agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxopt_train._checks import is_int
from jaxopt_train.collectives._axis import AxisName, axis_names, axis_size


def embedding_grad_exchange(ids: jax.Array, cotangent: jax.Array, axis_name: AxisName,
                            num_embeddings: int, *, out_dtype=None) -> jax.Array:
    """Summed-over-devices gradient of `table[ids]` w.r.t. `table`, from gathered rows.

    Args:
      ids: this device's integer indices, any shape S.
      cotangent: the lookup output's cotangent, shape S + (d,).
      axis_name: the data-parallel axis to sum over, or a tuple / list of axes (inside
        `jax.shard_map` / `jax.pmap`).
      num_embeddings: rows of the table (vocab size).
      out_dtype: gradient dtype (default `cotangent.dtype`); rows are added in f32.

    Returns:
      [num_embeddings, d] array, identical on every device of the axis: the sum
      over devices of each device's lookup gradient. All NaN if any device's
      ids leave [0, num_embeddings) (see the module docstring).
    """
    for name, value in (("ids", ids), ("cotangent", cotangent)):
        if not (hasattr(value, "dtype") and hasattr(value, "shape")):
            raise TypeError(f"{name} must be a jax or numpy array; got {type(value).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integers; got {ids.dtype}")
    # An integer gradient cannot hold the NaN that flags an out-of-range id
    # (NaN cast to int gives 0 or INT_MIN): a bad batch would pass the finite check.
    if not jnp.issubdtype(cotangent.dtype, jnp.floating):
        raise TypeError(f"cotangent must be a floating array (the lookup output's cotangent); "
                        f"got dtype={cotangent.dtype}")
    if cotangent.ndim != ids.ndim + 1 or cotangent.shape[:-1] != ids.shape:
        raise ValueError(f"cotangent must have shape ids.shape + (d,) = {ids.shape} + (d,); "
                         f"got {cotangent.shape}")
    if not is_int(num_embeddings) or num_embeddings < 1:
        raise ValueError(f"num_embeddings must be a positive int; got {num_embeddings!r}")
    if out_dtype is not None and not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"out_dtype must be a floating dtype (an out-of-range id is flagged with NaN); "
                        f"got {out_dtype=}")
    # A list names its axes as in the rings (it reached lax unhashable), and a repeated
    # name is refused by name (lax.all_gather said "repeated axis in `source` argument").
    names = axis_names(axis_name)
    axis_name = names[0] if len(names) == 1 else names
    axis_size(axis_name)  # a clear error when the axis is not bound here
    d = cotangent.shape[-1]
    dtype = cotangent.dtype if out_dtype is None else out_dtype
    if cotangent.size == 0:  # every device has these shapes: no rows to add (XLA cannot gather size 0)
        return jnp.zeros((int(num_embeddings), d), dtype)
    if jnp.dtype(ids.dtype).itemsize < 4:  # so that num_embeddings itself fits in the comparison
        ids = ids.astype(jnp.int32)
    all_ids = lax.all_gather(ids.reshape(-1), axis_name, tiled=True)
    all_rows = lax.all_gather(cotangent.reshape(-1, d), axis_name, tiled=True)
    in_range = (all_ids >= 0) & (all_ids < num_embeddings)
    # Every device gathered the same ids, so every device makes the same choice.
    grad = jnp.zeros((int(num_embeddings), d), jnp.float32).at[jnp.where(in_range, all_ids, 0)].add(
        all_rows.astype(jnp.float32))
    grad = jnp.where(jnp.all(in_range), grad, jnp.nan)
    return grad.astype(dtype)
