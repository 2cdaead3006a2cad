"""Matmul through a Triton kernel and `jax_triton.triton_call` (Ampere and newer).

The kernel (`_triton_src.matmul_kernel`) masks ragged edges itself, so any
M, N, K works without padding. Sizes are compile-time constants: each shape
compiles once, which is what a model's fixed layer shapes want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxopt_train.kernels.configs import MatmulConfig

_ACTIVATION_CODES = {None: 0, "gelu": 1, "relu": 2, "silu": 3}


def triton_matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, *,
                  activation: str | None, out_dtype, config: MatmulConfig,
                  transpose_a: bool = False, transpose_b: bool = False,
                  save_preactivation: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """act(A @ B + bias) in bf16/fp16 on a CUDA GPU.

    A is `a` (M, K), or `a.T` when `transpose_a` (`a` is (K, M)); B is `b` (K, N),
    or `b.T` when `transpose_b` (`b` is (N, K)). A transposed operand is read as
    stored through its strides: no transposed copy. With `save_preactivation`,
    returns (act(Z), Z), Z = A @ B + bias, both in `out_dtype` and from the same launch.
    """
    import jax_triton  # lazy: CPU-only jax raises ImportError here

    from jaxopt_train.kernels import _triton_src

    m, k = a.shape[::-1] if transpose_a else a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bk < 16:
        raise ValueError(f"triton tl.dot needs block_k >= 16; got {config}")
    # A 1-element placeholder keeps the kernel signature fixed when there is no bias.
    bias_arg = (jnp.zeros((1,), jnp.float32) if bias is None else bias.astype(jnp.float32))
    grid = (_cdiv(m, bm) * _cdiv(n, bn),)
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    # The kernel's pointers are (a, b, bias, z, c): inputs first, then outputs. Without Z
    # a 1-element placeholder input takes z's place, as for the bias.
    if save_preactivation:
        args, out_shape = (a, b, bias_arg), [out, out]
    else:
        args, out_shape = (a, b, bias_arg, jnp.zeros((1,), out_dtype)), out
    result = jax_triton.triton_call(
        *args,
        kernel=_triton_src.matmul_kernel,
        out_shape=out_shape,
        grid=grid,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name="jaxopt_triton_matmul",
        M=m, N=n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        HAS_BIAS=bias is not None, ACTIVATION=_ACTIVATION_CODES[activation],
        WRITE_Z=save_preactivation,
        STRIDE_AM=1 if transpose_a else k, STRIDE_AK=m if transpose_a else 1,
        STRIDE_BK=1 if transpose_b else n, STRIDE_BN=k if transpose_b else 1,
    )
    if save_preactivation:
        z, activated = result  # the outputs in the kernel's pointer order: z, then c
        return activated, z
    return result


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)
