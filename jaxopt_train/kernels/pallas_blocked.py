"""Blocked BlockSpec matmul: Mosaic TPU kernel, and the CPU interpret path.

Grid (M tiles, N tiles, K tiles), K innermost and sequential; an f32 VMEM
accumulator lives across the K steps, and the last K step applies the fused
epilogue (bias, activation) and writes one output tile. Shapes that are not
multiples of the tiles are zero-padded by the caller (`matmul.py`): zero rows
and columns add nothing to the dot product, so padding is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxopt_train.kernels.configs import MatmulConfig
from jaxopt_train.kernels.epilogue import apply_epilogue


def _blocked_kernel(a_ref, b_ref, bias_ref, out_ref, acc_ref, *, activation, upcast):
    """Refs: a (bm, bk), b (bk, bn), bias (1, bn) or None, out (bm, bn), acc f32 (bm, bn)."""
    from jax.experimental import pallas as pl

    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    a, b = a_ref[...], b_ref[...]
    if upcast:
        # XLA:CPU's DotThunk rejects some bf16 x bf16 -> f32 dots; bf16/fp16
        # products are exact in f32, so upcasting first changes no result.
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    acc_ref[...] += jnp.dot(a, b, preferred_element_type=jnp.float32)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _epilogue():
        bias = None if bias_ref is None else bias_ref[...]
        out_ref[...] = apply_epilogue(acc_ref[...], bias, activation).astype(out_ref.dtype)


def check_tpu_tiles(config: MatmulConfig, m: int, n: int, k: int) -> None:
    """Raises ValueError for tiles Mosaic TPU cannot lower on an (m, n, k) product.

    A block's two minor dims must be multiples of (8, 128) or span the whole (padded)
    array: block_n is the minor dim of the B, bias and output blocks and block_k that of
    the A block, so each must be a multiple of 128 unless the product fits in one tile
    along it (the caller pads to whole tiles, so such a block is the whole array dim).
    """
    for name, block, size in (("block_n", config.block_n, n), ("block_k", config.block_k, k)):
        if block % 128 and size > block:
            dim = name[-1].upper()
            raise ValueError(f"pallas_tpu needs MatmulConfig.{name} to be a multiple of 128 "
                             f"(Mosaic TPU's lane tiling) or >= {dim}; got {name}={block} for "
                             f"{dim}={size}: use {name}=128 or more")


def blocked_matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, *, activation: str | None,
                   out_dtype, config: MatmulConfig, interpret) -> jax.Array:
    """C = act(A @ B + bias) for tile-aligned 2-D A (M, K), B (K, N), bias (N,).

    Args:
        interpret: False for Mosaic TPU, True for the generic interpreter, or a
            `pltpu.InterpretParams` for the TPU-semantics interpreter.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    (m, k), (_, n) = a.shape, b.shape
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if m % bm or n % bn or k % bk:
        raise ValueError(f"blocked_matmul needs tile-aligned shapes; got {(m, n, k)=} "
                         f"for tiles {(bm, bn, bk)=}")
    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))]
    operands = [a, b]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))
        operands.append(bias.reshape(1, n))
    kernel = functools.partial(_blocked_kernel, activation=activation,
                               upcast=interpret is not False)
    if bias is None:
        kernel = functools.partial(_no_bias, kernel)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // bm, n // bn, k // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jaxopt_blocked_matmul",
    )(*operands)


def _no_bias(kernel, a_ref, b_ref, out_ref, acc_ref):
    kernel(a_ref, b_ref, None, out_ref, acc_ref)
