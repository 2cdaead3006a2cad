"""`matmul`'s custom VJP: dA = dZ @ B^T and dB = A^T @ dZ through the forward's backend.

Each forward rule calls its own custom_vjp function, and each backward computes
through custom_vjp functions only: a second derivative (grad of grad) differentiates
the forward and backward rules themselves, and a raw Pallas call there fails
(pallas_call's JVP rule asserts). Undifferentiated, a custom_vjp call runs its primal
function, so the first-order backward launches the same kernels. The kernels are
reached through the `matmul` module at call time (`_mm.<name>`), so they stay
patchable there.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxopt_train.kernels.epilogue import ACTIVATION_DERIVATIVES

# The module, not the package's `matmul` attribute (that is the function).
_mm = importlib.import_module("jaxopt_train.kernels.matmul")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _matmul_2d(a, b, bias, activation, out_dtype, backend, config, transpose_b=False,
               save_preactivation=False):
    """The differentiable product: 2-D operands, or N-D `a` on the xla backend."""
    return _mm._forward(a, b, bias, activation, out_dtype, backend, config, transpose_b)


def _matmul_2d_fwd(a, b, bias, activation, out_dtype, backend, config, transpose_b=False,
                   save_preactivation=False):
    if save_preactivation:
        out, z = _matmul_and_preactivation(a, b, bias, activation, out_dtype, backend, config,
                                           transpose_b)
        return out, (a, b, bias, z)
    out = _matmul_2d(a, b, bias, activation, out_dtype, backend, config, transpose_b)
    return out, (a, b, bias, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _matmul_and_preactivation(a, b, bias, activation, out_dtype, backend, config, transpose_b):
    """(act(Z), Z) (`_forward_with_preactivation`), differentiable in both outputs."""
    return _mm._forward_with_preactivation(a, b, bias, activation, out_dtype, backend, config,
                                       transpose_b)


def _matmul_and_preactivation_fwd(a, b, bias, activation, out_dtype, backend, config,
                                  transpose_b):
    out, z = _matmul_and_preactivation(a, b, bias, activation, out_dtype, backend, config,
                                       transpose_b)
    return (out, z), (a, b, bias, z)


def _matmul_and_preactivation_bwd(activation, out_dtype, backend, config, transpose_b,
                                  residuals, cotangents):
    # Only a higher-order derivative gets here (matmul returns act(Z) alone): Z's cotangent
    # adds to act(Z)'s pulled through the activation, and the sum is dZ of the product.
    g, g_z = cotangents
    a, b, bias, z = residuals
    dz = (g.astype(jnp.float32) * ACTIVATION_DERIVATIVES[activation](z)
          + g_z.astype(jnp.float32))
    return _matmul_2d_bwd(None, out_dtype, backend, config, transpose_b, False,
                          (a, b, bias, None), dz)


_matmul_and_preactivation.defvjp(_matmul_and_preactivation_fwd, _matmul_and_preactivation_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _linear(x, y, transposed, out_dtype, backend, config):
    """`x @ y`, `x.T @ y` (transposed="a") or `x @ y.T` ("b") on 2-D operands: the
    backward's products, differentiable again (for second derivatives)."""
    if transposed is None:
        return _mm._forward_impl(x, y, None, None, out_dtype, backend, config)
    return _mm._product_with_transpose(x, y, transposed, out_dtype, backend, config)


def _linear_fwd(x, y, transposed, out_dtype, backend, config):
    return _linear(x, y, transposed, out_dtype, backend, config), (x, y)


def _linear_bwd(transposed, out_dtype, backend, config, residuals, g):
    x, y = residuals
    g = g.astype(x.dtype)  # the products read the compute dtype, as dZ in `_matmul_2d_bwd`
    if transposed is None:  # C = x y: dx = g y^T, dy = x^T g
        return (_linear(g, y, "b", x.dtype, backend, config),
                _linear(x, g, "a", y.dtype, backend, config))
    if transposed == "a":  # C = x^T y, x (K, M): dx = y g^T, dy = x g
        return (_linear(y, g, "b", x.dtype, backend, config),
                _linear(x, g, None, y.dtype, backend, config))
    # C = x y^T, y (N, K): dx = g y, dy = g^T x
    return (_linear(g, y, None, x.dtype, backend, config),
            _linear(g, x, "a", y.dtype, backend, config))


_linear.defvjp(_linear_fwd, _linear_bwd)


def _epilogue_backward(activation, z, g, bias, compute_dtype, split_sum=False):
    """(dZ in the products' dtype, dbias) from the output's cotangent `g`; `z` is the
    pre-activation (None without an activation). `split_sum`: dbias in a pass of its own
    (GPU backends, below). `tools/probe_gpt1b.py --epilogue-bwd` replaces this function to
    time other formulations inside the step."""
    if activation is None:
        dz_compute = g.astype(compute_dtype)
    else:
        # Closed forms in f32 (epilogue.ACTIVATION_DERIVATIVES): none overflows, so fp16 is
        # safe too, and relu's is 0 at z == 0 and silu's finite for very negative z, where
        # autodiff of the forward's own functions gives 0.5 and NaN.
        derivative = ACTIVATION_DERIVATIVES[activation](z)
        dz_compute = (g.astype(jnp.float32) * derivative).astype(compute_dtype)
    if bias is None:
        return dz_compute, None
    if split_sum and activation is not None:
        # Two passes, dZ and then its column sum, not XLA's one fused pass: on the GPU that
        # one ran at half occupancy, computing the derivative while reducing. H200, gpt-1b
        # step, per fc layer (fifteenth session): one pass 219 us (tanh form) / 236 us (this
        # form, which XLA split itself, with dZ in f32 between); two passes 153 + 43 us (tanh)
        # / 132 + 43 us (this form). The barrier keeps XLA from fusing them back. Other
        # platforms (TPU, CPU) were not measured; XLA fuses there as it sees fit.
        dz_compute = jax.lax.optimization_barrier(dz_compute)
    # The column sum of the same rounded dZ the two products read (dbias as precise as dB),
    # as XLA sums its own bias gradients. Over every leading dim: the xla backend's dZ is N-D.
    rows = tuple(range(dz_compute.ndim - 1))
    dbias = jnp.sum(dz_compute.astype(jnp.float32), axis=rows).astype(bias.dtype)
    return dz_compute, dbias


def _float16_safe_cotangent(g, compute_dtype):
    """(g scaled by 2**-shift, shift) so that dZ fits fp16 when the products read fp16 and
    the cotangent is wider (an f32 or bf16 output): rounding g to fp16 made any |g| > 65504
    inf, and dA, dB, dbias with it, where lax.dot_general's gradients are finite. The shift
    (a power of two: exact) takes max|g| to [2**14, 2**15), leaving room for the
    activation's derivative (<= 1.13): down from past fp16's range, and up from below its
    normal range, where a small cotangent (an f32 head's mean loss, unscaled) flushed to
    zero. The products then write f32 and are scaled back there. The max is over finite
    entries, so one inf or NaN (propagated as the reference does) leaves the others
    shifted. (None, None) where g already fits: fp16 outputs, and bf16 products (f32's
    exponent range)."""
    if jnp.dtype(compute_dtype) != jnp.float16 or g.dtype == jnp.float16:
        return None, None
    g = g.astype(jnp.float32)
    magnitude = jnp.abs(jax.lax.stop_gradient(g))
    # max|g| < 2**exponent; an all-zero g gets exponent 0 and stays zero whatever the shift
    _, exponent = jnp.frexp(jnp.max(jnp.where(jnp.isfinite(magnitude), magnitude, 0)))
    shift = jnp.clip(exponent - 15, -120, 120)
    return jnp.ldexp(g, -shift), shift


def _out_sharding(x):
    """`out_sharding` for a backward product that makes x's gradient: x's own sharding type,
    which JAX cannot infer when the product contracts a sharded dim (as JAX's own transpose
    of dot_general passes it). None without a mesh."""
    sharding = jax.typeof(x).sharding
    if not sharding.mesh.empty:
        return sharding
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else jax.sharding.NamedSharding(mesh, P(*[None] * x.ndim))


def _xla_products(dz, a, b, transpose_b, da_dtype, db_dtype):
    """dA and dB on the xla backend, for N-D `a` and `dz` as given: merging their leading
    dims (as the kernels' 2-D operands do) is a reshape JAX refuses for operands typed with
    explicit sharding, and each product names its output's sharding (`_out_sharding`)."""
    last, rows = dz.ndim - 1, tuple(range(dz.ndim - 1))
    if jax.default_backend() == "cpu" and dz.dtype != jnp.float32:
        # XLA:CPU runs no bf16 x bf16 -> f32 dot with a transposed left operand, and under
        # jax.vmap the moveaxis below is folded back into one: widen (exact for bf16/fp16
        # products, which f32 holds), as the interpret kernel does.
        dz, a, b = (x.astype(jnp.float32) for x in (dz, a, b))
    da = jax.lax.dot_general(dz, b, (((last,), (0 if transpose_b else 1,)), ((), ())),
                             preferred_element_type=jnp.float32, out_sharding=_out_sharding(a))
    lhs, rhs = (dz, a) if transpose_b else (a, dz)  # dB = dZ^T A (N, K) or A^T dZ (K, N)
    # The transposed copy of the left operand, as the 2-D products take `a.T`: XLA:CPU runs
    # no bf16 x bf16 -> f32 dot that contracts its left operand's leading dims.
    lhs = jnp.moveaxis(lhs, -1, 0)
    db = jax.lax.dot_general(lhs, rhs, ((tuple(range(1, dz.ndim)), rows), ((), ())),
                             preferred_element_type=jnp.float32, out_sharding=_out_sharding(b))
    return da.astype(da_dtype), db.astype(db_dtype)


def _matmul_2d_bwd(activation, out_dtype, backend, config, transpose_b, save_preactivation,
                   residuals, g):
    a, b, bias, z = residuals
    if activation is not None and z is None:
        # Recompute the pre-activation instead of storing it (an M x N
        # residual per layer costs memory; this costs one more matmul).
        z = _matmul_2d(a, b, bias, None, jnp.float32, backend, config, transpose_b)
    scaled, shift = _float16_safe_cotangent(g, a.dtype)
    # Shifted, dbias is summed into f32 and unscaled there, as dA and dB are: cast to an fp16
    # bias's dtype first, the column sum of a dZ near 2**15 overflowed (inf) from 3 rows on.
    bias_like = bias
    if shift is not None and bias is not None:
        bias_like = jax.ShapeDtypeStruct(bias.shape, jnp.float32)  # only its dtype is read
    dz_compute, dbias = _epilogue_backward(activation, z, g if shift is None else scaled,
                                           bias_like, a.dtype,
                                           split_sum=backend in ("mosaic_gpu", "triton"))
    da_dtype, db_dtype = (a.dtype, b.dtype) if shift is None else (jnp.float32, jnp.float32)
    if backend == "xla":
        da, db = _xla_products(dz_compute, a, b, transpose_b, da_dtype, db_dtype)
    elif transpose_b:  # out = a @ b.T with b (N, K): dA = dz @ b, dB = dz.T @ a, both (.., K)
        da = _linear(dz_compute, b, None, da_dtype, backend, config)
        db = _linear(dz_compute, a, "a", db_dtype, backend, config)
    else:
        da = _linear(dz_compute, b, "b", da_dtype, backend, config)  # dz @ b.T
        db = _linear(a, dz_compute, "a", db_dtype, backend, config)  # a.T @ dz
    if bias is not None and backend == "xla":
        dbias = _sharded_like(dbias, bias)
    if shift is None:
        return da, db, dbias
    unscale = lambda x, like: jnp.ldexp(x.astype(jnp.float32), shift).astype(like.dtype)  # noqa: E731
    return unscale(da, a), unscale(db, b), None if bias is None else unscale(dbias, bias)


def _sharded_like(x, like):
    """`x` in `like`'s sharding type: dbias, a column sum of dZ, keeps dZ's N-sharding, and a
    custom_vjp's cotangent must have its primal's type (a bias placed replicated on the mesh
    of an N-sharded `b` failed with "Custom VJP bwd rule must produce an output with the same
    type")."""
    want = _out_sharding(like)
    if want is None or jax.typeof(x).sharding.spec == want.spec:
        return x
    return jax.sharding.reshard(x, want)


_matmul_2d.defvjp(_matmul_2d_fwd, _matmul_2d_bwd)
