"""Matmul through a Triton kernel and `jax_triton.triton_call` (Ampere and newer).

The kernel (`_triton_src.matmul_kernel`) masks ragged edges itself, so any
M, N, K works without whole-tile padding or an output slice. Only an operand
whose rows are not a multiple of 16 bytes is copied, zero-padded to that
(`aligned_operands`), so that Triton can pipeline its loads. Sizes are
compile-time constants: each shape compiles once, which is what a model's fixed
layer shapes want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxopt_train.kernels.configs import MatmulConfig
from jaxopt_train.kernels.matmul import _pad_to, _round_up

_ACTIVATION_CODES = {None: 0, "gelu": 1, "relu": 2, "silu": 3}
# Triton pipelines a tile load (cp.async into shared memory, num_stages deep) only when it
# can prove 16-byte vectors: an operand whose rows start off a 16-byte boundary (its minor
# dim not a multiple of 8 bf16/fp16 elements) is loaded element by element through
# registers instead. Checked in the sm_90 IR of this kernel (Triton 3.9): at 1000x777x513
# neither operand is pipelined (one shared-memory stage); with a vocabulary of 50,257 the
# head's backward products pipeline one operand of two.
_ALIGN = 8


def aligned_operands(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool,
                     multiple: int = _ALIGN):
    """(a, b, k, strides): the operands with each minor dim zero-padded to a multiple of
    `multiple` elements (1: as given), the contraction length the kernel loops over, and
    the element strides (STRIDE_AM, STRIDE_AK, STRIDE_BK, STRIDE_BN) of A = a or a.T and
    B = b or b.T as stored.

    An M or N pad only widens the stored rows: the kernel still masks at the true M and N,
    so the output keeps its shape and is not sliced. A K pad pads both operands' K (zeros
    add nothing to the product). Aligned operands come back as they are: no copy.
    """
    m, k = a.shape[::-1] if transpose_a else a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    if not transpose_a or transpose_b:  # K is the minor dim of an operand: pad it in both
        k = _round_up(k, multiple)
    a = _pad_to(a, (k, _round_up(m, multiple)) if transpose_a else (m, k))
    b = _pad_to(b, (n, k) if transpose_b else (k, _round_up(n, multiple)))
    strides = ((1, a.shape[1]) if transpose_a else (a.shape[1], 1)) + (
        (1, b.shape[1]) if transpose_b else (b.shape[1], 1))
    return a, b, k, strides


def triton_matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, *,
                  activation: str | None, out_dtype, config: MatmulConfig,
                  transpose_a: bool = False, transpose_b: bool = False,
                  save_preactivation: bool = False,
                  align: bool = True) -> jax.Array | tuple[jax.Array, jax.Array]:
    """act(A @ B + bias) in bf16/fp16 on a CUDA GPU.

    A is `a` (M, K), or `a.T` when `transpose_a` (`a` is (K, M)); B is `b` (K, N),
    or `b.T` when `transpose_b` (`b` is (N, K)). A transposed operand is read as
    stored through its strides: no transposed copy. With `save_preactivation`,
    returns (act(Z), Z), Z = A @ B + bias, both in `out_dtype` and from the same launch.
    `align` (default) pads each operand's minor dim to 16 bytes where it is not
    (`aligned_operands`); False reads the operands as given (A/B timing only).
    """
    import jax_triton  # lazy: CPU-only jax raises ImportError here

    from jaxopt_train.kernels import _triton_src

    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    a, b, k, strides = aligned_operands(a, b, transpose_a, transpose_b, _ALIGN if align else 1)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bk < 16:
        raise ValueError(f"triton tl.dot needs block_k >= 16; got {config}")
    # A 1-element placeholder keeps the kernel signature fixed when there is no bias (the
    # kernel never reads it). It is a slice of `a`, not jnp.zeros: a value computed from
    # constants alone inside a custom_vjp's primal shifts that custom_vjp's residuals in a
    # second derivative through lax.scan (jax 0.10; see matmul._pad_to).
    placeholder = a.reshape(-1)[:1]
    bias_arg = (placeholder.astype(jnp.float32) if bias is None else bias.astype(jnp.float32))
    grid = (_cdiv(m, bm) * _cdiv(n, bn),)
    # Element offsets are int32 in the kernel unless an array is too large for them
    # (e.g. the logits of 64 K tokens over a 50 K vocabulary: M * N > 2^31).
    wide_index = max(m * n, a.size, b.size) >= 2**31
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    # The kernel's pointers are (a, b, bias, z, c): inputs first, then outputs. Without Z
    # a 1-element placeholder input takes z's place, as for the bias.
    if save_preactivation:
        args, out_shape = (a, b, bias_arg), [out, out]
    else:
        args, out_shape = (a, b, bias_arg, placeholder.astype(out_dtype)), out
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
        WRITE_Z=save_preactivation, WIDE_INDEX=wide_index,
        STRIDE_AM=strides[0], STRIDE_AK=strides[1], STRIDE_BK=strides[2], STRIDE_BN=strides[3],
    )
    if save_preactivation:
        z, activated = result  # the outputs in the kernel's pointer order: z, then c
        return activated, z
    return result


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)
