"""The Triton (triton.language) matmul kernel. Imported only by triton_kernel.py, lazily.

This module imports `triton` at the top because `@triton.jit` resolves `tl`
from the defining module's globals; nothing else in the package imports it.
"""

import triton
import triton.language as tl

# A tl.constexpr: @triton.jit kernels may read only constexpr globals.
GELU_SCALE = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi): gelu_tanh(x) = x * sigmoid(GELU_SCALE * u)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, bias_ptr, z_ptr, c_ptr,
                  M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                  WRITE_Z: tl.constexpr, WIDE_INDEX: tl.constexpr,
                  STRIDE_AM: tl.constexpr, STRIDE_AK: tl.constexpr,
                  STRIDE_BK: tl.constexpr, STRIDE_BN: tl.constexpr):
    """C[M, N] = act(A[M, K] @ B[K, N] + bias[N]); f32 accumulation, C row-major.

    With WRITE_Z the epilogue also stores Z = A @ B + bias, rounded to z_ptr's dtype, next
    to C (cuBLASLt's GELU_AUX): the activation's backward reads it instead of a second
    product. z_ptr comes before c_ptr so that one signature serves both calls: without
    WRITE_Z it is a 1-element input that is never read; with it, the first output.

    A and B are read through their element strides, so a transposed operand is
    read as stored: A stored (K, M) has strides (1, M), B stored (N, K) (1, K).
    ACTIVATION: 0 none, 1 gelu (tanh approximation), 2 relu, 3 silu.
    WIDE_INDEX: offsets in int64 (the wrapper sets it when some array has >= 2^31 elements).
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row-tiles sweep the N tiles together, so the B
    # columns they load stay in L2 across the group.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if WIDE_INDEX:  # an operand or C has 2^31 elements or more: int32 offsets would wrap
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    # Out-of-range rows/cols wrap around to valid memory (results discarded by
    # the masked store), which keeps the main loop free of M/N masks. Along an
    # operand's minor dim (M of A stored (K, M), N of B stored (K, N)) they wrap at
    # the stored row's width, which the wrapper pads to a multiple of 8 elements, not
    # at M or N: a wrap at an odd size would leave Triton no 16-byte vectors to prove,
    # and it would load that operand element by element, unpipelined (sm_90 IR).
    # The contiguity hints hold only when no tile wraps.
    if M % BLOCK_M == 0:
        rows_in = tl.max_contiguous(tl.multiple_of(rows, BLOCK_M), BLOCK_M)
    elif STRIDE_AM == 1:
        rows_in = rows % STRIDE_AK
    else:
        rows_in = rows % M
    if N % BLOCK_N == 0:
        cols_in = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
        bias_cols = cols_in
    elif STRIDE_BN == 1:
        cols_in = cols % STRIDE_BK
        bias_cols = cols % N  # the bias has N entries, not the padded width
    else:
        cols_in = cols % N
        bias_cols = cols_in
    depth = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * STRIDE_AM + depth[None, :] * STRIDE_AK
    b_ptrs = b_ptr + depth[:, None] * STRIDE_BK + cols_in[None, :] * STRIDE_BN

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - step * BLOCK_K
            a = tl.load(a_ptrs, mask=depth[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=depth[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * STRIDE_AK
        b_ptrs += BLOCK_K * STRIDE_BK

    if HAS_BIAS:
        acc += tl.load(bias_ptr + bias_cols)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if WRITE_Z:
        tl.store(z_ptr + rows[:, None] * N + cols[None, :], acc.to(z_ptr.dtype.element_ty),
                 mask=mask)
    if ACTIVATION == 1:
        acc = acc * tl.sigmoid(GELU_SCALE * (acc + 0.044715 * acc * acc * acc))
    elif ACTIVATION == 2:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 3:
        acc = acc * tl.sigmoid(acc)

    c_ptrs = c_ptr + rows[:, None] * N + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
