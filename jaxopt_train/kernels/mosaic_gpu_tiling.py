"""The tilings the Mosaic GPU matmul can lower, checked in plain Python before lowering.

`MatmulConfig` accepts any power-of-two blocks; the Hopper kernel (`mosaic_gpu.py`)
accepts fewer, and a tiling outside them used to fail deep in the Pallas lowering with
a bare `AssertionError` or "Swizzle 16 is not supported". The rules below were read
off lowering every block combination for cuda on CPU (block_m 64-256, block_n 8-256,
block_k 16-128, both consumer splits, clusters, ping-pong, each transposed operand,
bf16 and f32 outputs) and agree with it on every one:

  - wgmma: block_m a multiple of 64, block_n a multiple of 8 and <= 256.
  - Shared-memory tiles are swizzled along their stored rows, in 32-, 64- or 128-byte
    patterns; A's (block_k wide) sets the swizzle, and B's must match it (wgmma).
  - A B tile stored (block_k, block_n) is swizzled like A, so block_n must span whole
    swizzle rows; a transposed A is stored (block_k, M) with 128-byte rows, so B's
    block_k rows must be 128-byte ones too.
  - The epilogue slices the accumulator into (min(epilogue_tile, block_m),
    min(epilogue_tile, block_n)) sub-tiles: whole 64-row tiles of its register layout,
    staged through swizzled shared memory in rows of at least 32 bytes.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxopt_train.kernels.configs import MatmulConfig

_SWIZZLES = (128, 64, 32)  # bytes; Mosaic GPU has no 16-byte swizzle


def swizzle_bytes(row_bytes: int) -> int:
    """The widest swizzle that tiles rows of `row_bytes` (0 if none does)."""
    return next((s for s in _SWIZZLES if row_bytes % s == 0), 0)


def check_tiling(config: MatmulConfig, in_dtype, out_dtype, *, transpose_a: bool = False,
                 transpose_b: bool = False) -> None:
    """Raises ValueError, naming the field to change, for a tiling the kernel cannot lower."""
    _check_wgmma_shape(config)
    _check_operand_swizzles(config, jnp.dtype(in_dtype).itemsize, transpose_a, transpose_b)
    _check_epilogue(config, jnp.dtype(out_dtype))
    if (transpose_a or transpose_b) and config.warpgroup_lowering:
        raise ValueError(f"mosaic_gpu reads transposed operands with warpgroup_lowering=False "
                         f"only; got {config.warpgroup_lowering=} with {transpose_a=}, "
                         f"{transpose_b=}")


def _check_wgmma_shape(config: MatmulConfig) -> None:
    if config.block_m % 64:
        raise ValueError(f"mosaic_gpu needs block_m to be a multiple of 64 (one wgmma is 64 "
                         f"rows); got {config.block_m=}")
    if config.block_n % 8 or config.block_n > 256:
        raise ValueError(f"mosaic_gpu needs block_n to be a multiple of 8 and <= 256 (wgmma's "
                         f"N); got {config.block_n=}")


def _check_operand_swizzles(config: MatmulConfig, itemsize: int, transpose_a: bool,
                            transpose_b: bool) -> None:
    k_row = config.block_k * itemsize
    swizzle = swizzle_bytes(k_row)
    if not swizzle:
        raise ValueError(f"mosaic_gpu needs block_k * itemsize to be a multiple of 32 bytes "
                         f"(the narrowest swizzle); got {config.block_k=} x {itemsize} B = "
                         f"{k_row} B: use block_k >= {32 // itemsize}")
    if transpose_a and swizzle != 128:
        raise ValueError(f"mosaic_gpu reads a transposed A in 128-byte swizzled rows, and "
                         f"wgmma needs B's block_k rows to match: block_k * itemsize must be a "
                         f"multiple of 128 bytes; got {config.block_k=} x {itemsize} B = "
                         f"{k_row} B: use block_k={128 // itemsize}")
    n_row = config.block_n * itemsize
    if not transpose_b and n_row % swizzle:
        raise ValueError(f"mosaic_gpu swizzles B's (block_k, block_n) tiles like A's "
                         f"{swizzle}-byte rows (block_k={config.block_k}), so block_n must "
                         f"span {swizzle} bytes; got {config.block_n=} x {itemsize} B = "
                         f"{n_row} B: use block_n >= {swizzle // itemsize} or a smaller "
                         f"block_k")


def _check_epilogue(config: MatmulConfig, out_dtype) -> None:
    if config.epilogue_tile < 64:  # it slices the accumulator, whose layout has 64-row tiles
        raise ValueError(f"mosaic_gpu slices the wgmma accumulator into epilogue_tile-row "
                         f"sub-tiles, and its register layout comes in 64-row tiles: "
                         f"epilogue_tile must be >= 64; got {config.epilogue_tile=}")
    epi_n = min(config.epilogue_tile, config.block_n)
    if epi_n * out_dtype.itemsize < 32:
        raise ValueError(f"mosaic_gpu stores the output through swizzled sub-tiles "
                         f"min(epilogue_tile, block_n) wide, which need rows of >= 32 bytes; "
                         f"got {config.block_n=}, {config.epilogue_tile=} with "
                         f"out_dtype={out_dtype.name} ({epi_n * out_dtype.itemsize} B): use "
                         f"block_n >= {32 // out_dtype.itemsize}")
