"""An embedding lookup whose gradient is summed in float32.

`nnx.Embed` casts the table to the compute dtype and gathers from the cast copy, so
its gradient is a scatter-add in that dtype: in bf16 every token's row is added
into an 8-bit-mantissa accumulator. A frequent token (the space in source code,
~30% of positions) collects thousands of rows per step; once the running sum is a
few hundred times one addend, further addends round away. On CPU that gave a 9%
error on such a row's gradient (`tests/test_models_embedding.py`). On the GPU its
time also grew with the gradients' values as gpt-124m trained (as a compare-and-swap
loop for 16-bit adds would; the trace shows only the kernel's time): 13.8 ms of a
43 ms step at step 100, 49 ms of 78 ms at step 650 (BENCHMARKS.md, thirtieth session).

`embedding_lookup` gathers rows of the stored table and casts only those rows; its
backward adds the rows' cotangents in float32, which GPUs add atomically in hardware,
and casts the summed table once, to the table's own dtype. `Embed` and `LinenEmbed`
are the `nnx.Embed` and `linen.Embed` drop-ins built on it. `low_precision_embeds`
finds the nnx.Embed modules that would still sum in 16 bits, and `linen_embeds_called`
the linen.Embed ones a Linen module calls (its submodules exist only while it runs,
so they are recorded during `init`); the Trainer warns about both.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx


def embedding_lookup(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """Rows ``table[ids]`` cast to ``dtype``; the table's gradient is summed in float32.

    Args:
      table: [num_embeddings, features], a floating array (the parameter as stored).
      ids: integer array of any shape. An id outside [0, num_embeddings), negative
        ones included, gives a NaN row and adds nothing to the gradient.
      dtype: floating dtype of the returned rows; None: the table's (as nnx.Embed and
        linen.Embed with ``dtype`` unset).

    Returns:
      ``ids.shape + (features,)`` in ``dtype``.

    Raises:
      ValueError: a table that is not 2-D and floating, non-integer ids, or a
        non-floating ``dtype``.
    """
    table, ids = jnp.asarray(table), jnp.asarray(_fit_host_ids(ids))
    if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"table must be a floating array [num_embeddings, features], got "
                         f"shape={table.shape} dtype={table.dtype}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer array, got dtype={ids.dtype}")
    # np.dtype(None) is float64, which JAX would make float32: a bf16 table's rows came back f32.
    if dtype is None:
        dtype = table.dtype
    else:
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:  # "bf16" and the like: numpy's message names no argument
            raise ValueError(f"dtype must be a floating dtype such as jnp.bfloat16 or "
                             f"'bfloat16', got {dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (an out-of-range id gives a NaN row), got {dtype}")
    rows = table.shape[0]
    # jnp.take and .at[] read a negative id from the end of the table, even in fill and
    # drop mode: every id outside [0, rows) becomes `rows` here, which both treat as
    # out of range. Compared in the ids' own dtype (int8 cannot hold 256: then every
    # non-negative id is in range), cast to int32 only once known to fit.
    in_range = ids >= 0
    if np.iinfo(ids.dtype).max >= rows:
        in_range &= ids < rows
    ids = jnp.where(in_range, ids.astype(jnp.int32), rows)
    return _lookup(table, ids, dtype)


def _fit_host_ids(ids):
    """Host 64-bit ids as JAX will hold them: without x64 jnp.asarray wraps them to int32, so
    an id of 2**32 + 1 read row 1. Those past int32 become -1 here, out of range (a NaN row)."""
    # np.generic too: a NumPy scalar (labels[i]) wrapped as an array does, 2**32 + 1 to row 1.
    if (isinstance(ids, (np.ndarray, np.generic)) and ids.dtype.kind in "iu" and ids.dtype.itemsize == 8
            and jax.dtypes.canonicalize_dtype(ids.dtype).itemsize < 8):
        fits = (ids >= 0) & (ids <= np.iinfo(np.int32).max)
        # -1 set after the cast: NumPy 2 refuses it as a uint64 in np.where.
        return np.where(fits, np.where(fits, ids, 0).astype(np.int32), np.int32(-1))
    return ids


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, dtype):
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan).astype(dtype)


def _lookup_fwd(table, ids, dtype):
    # The table's row count and dtype only: a zero-size stand-in, not the table itself.
    return _lookup(table, ids, dtype), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_bwd(dtype, residuals, g):
    ids, like = residuals
    grad = jnp.zeros((like.shape[0], g.shape[-1]), jnp.float32).at[ids].add(
        g.astype(jnp.float32), mode="drop")
    # Integer ids have no cotangent (None: a symbolic zero).
    return grad.astype(like.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _integer_ids(module, inputs) -> jax.Array:
    """The drop-ins' own check, before `embedding_lookup`'s: the message names the module."""
    # Host ids fitted first: a bare jnp.asarray wrapped an int64 2**32 + 1 to row 1.
    inputs = jnp.asarray(_fit_host_ids(inputs))
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError(f"{type(module).__name__} takes integer ids, got dtype={inputs.dtype}")
    return inputs


class Embed(nnx.Embed):
    """`nnx.Embed` whose table gradient is summed in float32 (`embedding_lookup`).

    A drop-in: the same constructor, parameter (``embedding``), ``attend`` and
    ``out_sharding``, and the same rows. Differences from `nnx.Embed`:
    ``promote_dtype`` is not used (the rows are cast to ``dtype``), and a negative
    id gives a NaN row, as an id past the table does (nnx.Embed reads it from the
    table's end).
    """

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        inputs = _integer_ids(self, inputs)
        # No one-row shortcut (nnx.Embed broadcasts its row): that returned the row for any
        # id, -1 or 7 included, ignored out_sharding, and rounded the summed gradient to
        # the 16-bit compute dtype; `embedding_lookup` handles one row like any other.
        dtype = self.dtype

        def lookup(table, ids):
            return embedding_lookup(table, ids, dtype)

        if out_sharding is not None:  # as nnx.Embed: jnp.take takes no out_sharding
            lookup = jax.sharding.auto_axes(lookup, out_sharding=out_sharding)
        return lookup(self.embedding[...], inputs)


class LinenEmbed(linen.Embed):
    """`linen.Embed` whose table gradient is summed in float32 (`embedding_lookup`).

    A drop-in: the same fields, parameter (``embedding``) and ``attend``. This matters
    more in Linen: with ``dtype`` unset, linen.Embed gathers from the table as it is
    passed in, which under a bf16 policy (`precision.linen_apply`, the Trainer) is
    the bf16 copy. Differences from linen.Embed: ``promote_dtype`` is not used, and a
    negative id gives a NaN row, as an id past the table does.
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        inputs = _integer_ids(self, inputs)
        # No one-row shortcut, as in `Embed`: an out-of-range id gives a NaN row here too.
        table = self.embedding
        return embedding_lookup(table, inputs, table.dtype if self.dtype is None else self.dtype)


def low_precision_embeds(model) -> list[str]:
    """Paths of the `nnx.Embed` modules in ``model`` (not `Embed`) that sum their
    table's gradient in a 16-bit dtype: those whose ``dtype`` is bf16 or fp16.
    (With ``dtype`` left unset, nnx.Embed casts a bf16 table back up to its
    float32 param dtype, so its scatter-add is in float32.)"""
    found = []
    for path, node in nnx.iter_graph(model):
        if (isinstance(node, nnx.Embed) and not isinstance(node, Embed) and node.num_embeddings > 1
                and _is_16_bit(node.dtype)):
            found.append(".".join(map(str, path)) or "(the model)")
    return found


def _is_16_bit(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


@contextlib.contextmanager
def linen_embeds_called():
    """Records the plain `linen.Embed` modules (not `LinenEmbed`) called inside the block.

    Yields a list that fills with ``(path, dtype)`` per such module with more than one
    row, in call order and once each: ``path`` is the module's name path ("embed",
    "encoder.tokens"), ``dtype`` its ``dtype`` field (None when unset, so that it
    gathers from the table in whatever dtype the table is passed). Wrap a
    ``module.init(...)`` with it: a Linen module's submodules exist only while it runs.
    """
    seen: list[tuple[str, object]] = []
    paths: set[str] = set()

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if (context.method_name == "__call__" and isinstance(module, linen.Embed)
                and not isinstance(module, LinenEmbed) and module.num_embeddings > 1):
            path = ".".join(map(str, module.path)) or "(the model)"
            if path not in paths:
                paths.add(path)
                seen.append((path, module.dtype))
        return next_fun(*args, **kwargs)

    with linen.intercept_methods(interceptor):
        yield seen


def low_precision_linen_embeds(seen, table_dtype) -> list[str]:
    """Paths among `linen_embeds_called`'s ``seen`` whose lookup, and so whose gradient's
    scatter-add, is 16-bit when the table arrives in ``table_dtype`` (the compute dtype
    a policy casts params to): a set ``dtype`` decides, an unset one keeps the table's."""
    return [path for path, dtype in seen
            if _is_16_bit(table_dtype if dtype is None else dtype)]
