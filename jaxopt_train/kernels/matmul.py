"""`matmul`: one differentiable entry point over every matmul kernel backend.

    C = activation(A @ B + bias)     A: (..., M, K), B: (K, N), bias: (N,)

Precision rule (stated once, applied by every backend, the reference included):
inputs must share one dtype among bfloat16, float16 and float32; float32 inputs
are rounded to bfloat16 first (the tensor-core input type); products accumulate
in float32, the epilogue runs in float32, and the result is cast to `out_dtype`
(default: the dtype A arrived in).

Backends: "mosaic_gpu" (Pallas on Hopper: TMA, wgmma, warp-specialised
pipeline), "triton" (jax-triton custom call, Ampere and newer), "pallas_tpu" (Mosaic TPU BlockSpec
kernel), "interpret" (that same BlockSpec kernel interpreted on any platform),
"xla" (`jnp.dot`, the fallback) and "auto" (picked by platform, logged at debug
level; XLA's dot on a shape where `autotune` timed it faster than the kernel). The VJP
(`matmul_vjp`) runs dA = dZ @ B^T and dB = A^T @ dZ through the same backend.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_train._typed_sharding import (explicit_sharding, to_varying, varying_axes,
                                          varying_axes_of_tree)
from jaxopt_train.kernels import configs
from jaxopt_train.kernels.configs import (ACTIVATIONS, BACKENDS, TRANSPOSING_BACKENDS, MatmulConfig,
                                          as_config)
from jaxopt_train.kernels.epilogue import apply_epilogue
from jaxopt_train.precision import as_float_dtype

logger = logging.getLogger(__name__)

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
OUTPUT_DTYPES = INPUT_DTYPES


# ----------------------------------------------------------------------------- validation
def _check_inputs(a, b, bias, activation, out_dtype, transpose_b=False):
    """Validates the public arguments; returns (compute_dtype, out_dtype)."""
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if a.ndim < 2:
        raise ValueError(f"a must have rank >= 2 (..., M, K); got {a.shape=}")
    layout = "(N, K) with transpose_b=True" if transpose_b else "(K, N)"
    if b.ndim != 2:
        raise ValueError(f"b must have rank 2 {layout}; got {b.shape=}")
    k_axis = 1 if transpose_b else 0
    n = b.shape[1 - k_axis]
    if a.shape[-1] != b.shape[k_axis]:
        raise ValueError(f"contracting dims differ: a.shape[-1]={a.shape[-1]} (K) but "
                         f"b.shape[{k_axis}]={b.shape[k_axis]}; expected a (..., M, K) and b {layout}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype; got {a.dtype=} and {b.dtype=} "
                        f"(cast one of them; legal: bfloat16, float16, float32)")
    if jnp.dtype(a.dtype) not in INPUT_DTYPES:
        raise TypeError(f"{a.dtype=} is not supported; expected one of bfloat16, float16, float32")
    if bias is not None:
        if not hasattr(bias, "shape") or not hasattr(bias, "dtype"):
            raise TypeError(f"bias must be an array of shape (N,)=({n},) or None, got {type(bias).__name__}")
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape (N,)=({n},); got {bias.shape=}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point; got {bias.dtype=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{activation=} is not supported; expected one of {ACTIVATIONS}")
    given = out_dtype
    try:
        out_dtype = jnp.dtype(a.dtype if given is None else as_float_dtype(given, "out_dtype"))
    except (TypeError, ValueError):
        out_dtype = None
    if out_dtype not in OUTPUT_DTYPES:  # one message and type for int8, "int8", float64 alike
        raise ValueError(f"out_dtype={given!r} is not supported; expected one of bfloat16, float16, "
                         "float32, or None for a's dtype")
    compute = jnp.dtype(jnp.bfloat16) if a.dtype == jnp.float32 else jnp.dtype(a.dtype)
    return compute, out_dtype


def _check_unsharded(backend: str, **operands) -> None:
    sharded = {name: spec for name, x in operands.items()
               if x is not None and (spec := explicit_sharding(x)) is not None}
    if sharded:
        given = ", ".join(f"{name}: {spec}" for name, spec in sharded.items())
        raise ValueError(f"matmul backend {backend!r} runs a Pallas kernel, which takes operands "
                         f"without explicit sharding; got {given}: call matmul inside "
                         f"jax.shard_map (on per-device shards), use a mesh with AxisType.Auto "
                         f"axes, or backend='xla'")


def pallas_refuses_here(x, backend: str) -> bool:
    """Whether `backend` is a BlockSpec kernel (interpret, pallas_tpu) and this trace is
    inside `jax.shard_map` with varying-axes checking on (`check_vma=True`, its default),
    whose types their pallas_call refuses ("manual_axis_type on jax.ShapeDtypeStruct must
    not be None") where lax.dot_general works. Only under checking does casting `x` to
    vary over the manual axes type it so (the unused cast is dropped)."""
    if backend not in ("interpret", "pallas_tpu"):
        return False
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return bool(manual) and bool(varying_axes(to_varying(x, manual)))


# ----------------------------------------------------------------------------- backends
def _mosaic_gpu_available() -> tuple[bool, str]:
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    devices = jax.devices()
    if devices[0].platform != "gpu":
        return False, f"needs a GPU; jax.devices()[0].platform={devices[0].platform!r}"
    capability = str(getattr(devices[0], "compute_capability", ""))
    if compute_capability(devices[0])[0] != 9:
        return False, f"needs a Hopper GPU (compute capability 9.x); got {capability!r}"
    try:
        importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    except ImportError as err:
        return False, f"jax.experimental.pallas.mosaic_gpu failed to import: {err}"
    return True, f"Hopper GPU ({devices[0].device_kind}, sm_{capability.replace('.', '')})"


def _triton_available() -> tuple[bool, str]:
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    devices = jax.devices()
    if devices[0].platform != "gpu":
        return False, f"needs a CUDA GPU; jax.devices()[0].platform={devices[0].platform!r}"
    # The kernel's bf16 dot needs the bf16 tensor-core instructions that came with Ampere
    # (sm_80): on a T4 (7.5) "auto" must fall to xla rather than pick a kernel that fails.
    capability = str(getattr(devices[0], "compute_capability", ""))
    if compute_capability(devices[0]) < (8, 0):
        return False, (f"needs an NVIDIA Ampere or newer GPU (compute capability >= 8.0); "
                       f"got compute_capability={capability!r}")
    try:
        import jax_triton  # noqa: F401
    except ImportError as err:  # CPU-only jax raises ImportError, not ModuleNotFoundError
        return False, f"jax_triton is not importable ({err}); pip install jax-triton"
    return True, f"CUDA GPU ({devices[0].device_kind}) with jax_triton"


def _tpu_available() -> tuple[bool, str]:
    platform = jax.devices()[0].platform
    if platform != "tpu":
        return False, f"needs a TPU; jax.devices()[0].platform={platform!r} (use 'interpret' on CPU)"
    return True, "TPU"


_AVAILABILITY = {"mosaic_gpu": _mosaic_gpu_available, "triton": _triton_available,
                 "pallas_tpu": _tpu_available}


def available_backends() -> list[str]:
    """Concrete backends usable on this process's default device, fastest first."""
    usable = [name for name, check in _AVAILABILITY.items() if check()[0]]
    return usable + ["interpret", "xla"]


def resolve_backend(backend: str) -> str:
    """Maps "auto" to a concrete backend; checks an explicit one is usable here."""
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} is unknown; expected one of {BACKENDS}")
    if backend in _AVAILABILITY:
        ok, why = _AVAILABILITY[backend]()
        if not ok:
            raise RuntimeError(f"matmul backend {backend!r} is unavailable: {why}")
        return backend
    if backend != "auto":
        return backend
    for candidate in ("mosaic_gpu", "pallas_tpu", "triton"):
        ok, why = _AVAILABILITY[candidate]()
        if ok:
            logger.debug("matmul backend auto -> %s: %s", candidate, why)
            return candidate
    logger.debug("matmul backend auto -> xla: no Pallas/Triton kernel backend on %s",
                 jax.devices()[0].platform)
    return "xla"


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def _device_capability() -> tuple[int, int]:
    """The default device's CUDA compute capability; (0, 0) on a CPU or TPU."""
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    return compute_capability(jax.devices()[0])


def resolve_config(backend: str, m: int, n: int, k: int, dtype,
                   transposed: str | None = None) -> MatmulConfig:
    """Autotuned winner from the on-disk cache if present, else the shipped default.

    `transposed` ("a" / "b": that operand read as stored) looks up that layout's own
    entry only: a plain A @ B winner is no evidence for the transposed kernel (on an
    H200 it made gpt-1b's backward slower), so an untuned layout gets the default.
    """
    from jaxopt_train.kernels.autotune_cache import lookup

    cached = lookup(backend, _device_kind(), m, n, k, dtype, transposed)
    if cached is not None:
        return cached
    # The capability fits a Triton tile to the device's shared memory (configs.default_config).
    return configs.default_config(backend, _device_kind(), m, n, k,
                                  compute_capability=_device_capability())


# ----------------------------------------------------------------------------- kernels
def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(x - 1).bit_length()))


def _pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # lax.pad with a typed zero, not jnp.pad: jnp.pad is a jit called with a literal
    # operand, and a jit with a literal operand inside a custom_vjp's primal shifts that
    # custom_vjp's residuals in a second derivative through lax.scan (jax 0.10: the backward
    # received the literal in place of `a`; tests/test_kernels.py pins it).
    if x.shape == tuple(shape):
        return x
    return jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, t - s, 0) for s, t in zip(x.shape, shape)])


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _blocked(a, b, bias, activation, out_dtype, config, interpret):
    from jaxopt_train.kernels.pallas_blocked import blocked_matmul, check_tpu_tiles

    (m, k), n = a.shape, b.shape[1]
    if interpret is False:
        check_tpu_tiles(config, m, n, k)
    else:
        # Interpreted grids cost per step: never tile past the (pow2-rounded) problem.
        config = MatmulConfig(**{**config.to_dict(),
                                 "block_m": min(config.block_m, _pow2_at_least(m, 8)),
                                 "block_n": min(config.block_n, _pow2_at_least(n, 8)),
                                 "block_k": min(config.block_k, _pow2_at_least(k, 8))})
    mp, np_, kp = (_round_up(m, config.block_m), _round_up(n, config.block_n),
                   _round_up(k, config.block_k))
    out = blocked_matmul(_pad_to(a, (mp, kp)), _pad_to(b, (kp, np_)),
                         None if bias is None else _pad_to(bias, (np_,)),
                         activation=activation, out_dtype=out_dtype, config=config,
                         interpret=interpret)
    return out[:m, :n]


def _xla(a, b, bias, activation, out_dtype):
    acc = jnp.dot(a, b, preferred_element_type=jnp.float32)
    return apply_epilogue(acc, bias, activation).astype(out_dtype)


def _forward_impl(a, b, bias, activation, out_dtype, backend, config, save_preactivation=False):
    """One 2-D kernel launch on already-validated, compute-dtype operands (with
    `save_preactivation`, Triton or Mosaic GPU: (act(Z), Z) from that one launch)."""
    if backend == "xla":
        return _xla(a, b, bias, activation, out_dtype)
    (m, k), n = a.shape, b.shape[1]
    config = config or resolve_config(backend, m, n, k, a.dtype)
    return _launch(a, b, bias, activation=activation, out_dtype=jnp.dtype(out_dtype),
                   backend=backend, config=config, save_preactivation=save_preactivation)


# Each launch is its own jit so that a model lowers one kernel per distinct (shapes,
# config), however many layers call it: gpt-1b's 16 unrolled layers make 195 kernel
# calls of 15 distinct kinds, and lowering one Mosaic GPU kernel costs ~0.3 s of Python
# (plus its tracing). XLA inlines the calls again, so the compiled step is unchanged.
@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "backend", "config",
                                             "transposed", "save_preactivation"))
def _launch(a, b, bias, *, activation, out_dtype, backend, config, transposed=None,
            save_preactivation=False):
    """`act(A @ B + bias)` by `backend`'s kernel. A is `a`, B is `b`, except that with
    `transposed` "a" / "b" (Mosaic GPU and Triton) A is `a.T` / B is `b.T`, read as stored.
    `save_preactivation` (Triton, and Mosaic GPU untransposed): returns (act(Z), Z) from
    one kernel."""
    out = _kernel_call(a, b, bias, activation=activation, out_dtype=out_dtype, backend=backend,
                       config=config, transposed=transposed, save_preactivation=save_preactivation)
    # Inside shard_map with varying-axes checking, the GPU kernels' outputs come back typed
    # invariant (Mosaic GPU's pallas_call and jax-triton's custom call set no varying axes),
    # though each device computed its own: typed so, a later psum would count one device's
    # value n times, and the custom VJP refused dA for a per-device `a` ("the manual axis
    # types do not match", on the GPU). They vary as their operands do. A no-op elsewhere.
    return to_varying(out, varying_axes_of_tree((a, b, bias)))


def _kernel_call(a, b, bias, *, activation, out_dtype, backend, config, transposed,
                 save_preactivation):
    """`_launch`'s kernel, untyped: see `_launch`."""
    flags = dict(transpose_a=transposed == "a", transpose_b=transposed == "b")
    if save_preactivation:
        if backend == "triton":
            from jaxopt_train.kernels.triton_kernel import triton_matmul

            return triton_matmul(a, b, bias, activation=activation, out_dtype=out_dtype,
                                 config=config, save_preactivation=True, **flags)
        if backend != "mosaic_gpu" or transposed is not None:
            raise ValueError(f"one kernel writes the pre-activation only on triton and on "
                             f"mosaic_gpu untransposed; got {backend=}, {transposed=}")
        from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

        return mosaic_matmul(a, b, bias, activation=activation, out_dtype=out_dtype, config=config,
                             save_preactivation=True)
    if transposed is not None:
        if backend == "mosaic_gpu":
            from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

            return mosaic_matmul(a, b, bias, activation=activation, out_dtype=out_dtype, config=config, **flags)
        if backend == "triton":
            from jaxopt_train.kernels.triton_kernel import triton_matmul

            return triton_matmul(a, b, bias, activation=activation, out_dtype=out_dtype, config=config, **flags)
        raise ValueError(f"transposed operands are read as stored only by mosaic_gpu and triton; "
                         f"got {backend=}")
    if backend == "interpret":
        return _blocked(a, b, bias, activation, out_dtype, config, interpret=True)
    if backend == "pallas_tpu":
        return _blocked(a, b, bias, activation, out_dtype, config, interpret=False)
    if backend == "mosaic_gpu":
        from jaxopt_train.kernels.mosaic_gpu import mosaic_matmul

        return mosaic_matmul(a, b, bias, activation=activation, out_dtype=out_dtype, config=config)
    if backend == "triton":
        from jaxopt_train.kernels.triton_kernel import triton_matmul

        return triton_matmul(a, b, bias, activation=activation, out_dtype=out_dtype, config=config)
    raise ValueError(f"{backend=} is not a concrete backend; expected one of {BACKENDS[1:]}")


def reads_transposed_as_stored(backend: str, config: MatmulConfig, dtype) -> bool:
    """Whether `backend` with `config` reads a transposed operand as stored (else a
    transposed product multiplies a transposed copy, with the plain layout's config).

    Mosaic GPU: wgmma needs the two tiles' swizzles to match; a transposed tile is
    swizzled over its M/N extent (128 B), so the K tile must span 128 B as well.
    """
    return backend == "triton" or (backend == "mosaic_gpu" and not config.warpgroup_lowering
                                   and config.block_k * jnp.dtype(dtype).itemsize == 128)


def _product_with_transpose(a, b, transposed: str, out_dtype, backend, config, bias=None,
                            activation=None, save_preactivation=False):
    """`act(a.T @ b + bias)` (transposed="a") or `act(a @ b.T + bias)` (transposed="b").

    The Mosaic GPU kernel reads the transposed operand as stored (TMA tiles viewed
    transposed by wgmma), and so does Triton (through the operand's strides); the
    other backends multiply a transposed copy. `save_preactivation` (Triton only):
    (act(Z), Z) from the one launch.
    """
    if save_preactivation and backend != "triton":
        raise ValueError(f"a transposed product writes the pre-activation only on triton; "
                         f"got {backend=}")
    lhs, rhs = (a.T, b) if transposed == "a" else (a, b.T)
    if backend in TRANSPOSING_BACKENDS:
        (m, k), n = lhs.shape, rhs.shape[1]  # shapes only: XLA drops the unused transposes
        cfg = config or resolve_config(backend, m, n, k, a.dtype, transposed)
        if reads_transposed_as_stored(backend, cfg, a.dtype):
            return _launch(a, b, bias, activation=activation, out_dtype=jnp.dtype(out_dtype),
                           backend=backend, config=cfg, transposed=transposed,
                           save_preactivation=save_preactivation)
    return _forward_impl(lhs, rhs, bias, activation, out_dtype, backend, config)


def _forward(a, b, bias, activation, out_dtype, backend, config, transpose_b,
             save_preactivation=False):
    """`act(a @ B + bias)` with B = `b`, or `b.T` when `transpose_b` (b is (N, K));
    with `save_preactivation`, (act(Z), Z) from one launch (see `_launch`)."""
    if transpose_b:
        return _product_with_transpose(a, b, "b", out_dtype, backend, config, bias, activation,
                                       save_preactivation)
    return _forward_impl(a, b, bias, activation, out_dtype, backend, config, save_preactivation)


def writes_preactivation(backend: str, transpose_b: bool = False) -> bool:
    """Whether `backend`'s kernel writes act(Z) and Z in one launch (cuBLASLt's GELU_AUX):
    Triton always, Mosaic GPU when B is not transposed."""
    return backend == "triton" or (backend == "mosaic_gpu" and not transpose_b)


def _forward_with_preactivation(a, b, bias, activation, out_dtype, backend, config, transpose_b):
    """(act(Z), Z) with Z = a @ B + bias, both in `out_dtype`, the activation applied to the
    f32 Z: one Triton or Mosaic GPU kernel writes both; elsewhere the kernel writes Z in f32
    and XLA applies the activation and both casts in one elementwise pass."""
    if writes_preactivation(backend, transpose_b):
        return _forward(a, b, bias, activation, out_dtype, backend, config, transpose_b,
                        save_preactivation=True)
    z = _forward(a, b, bias, None, jnp.float32, backend, config, transpose_b)
    return apply_epilogue(z, None, activation).astype(out_dtype), z.astype(out_dtype)


# ----------------------------------------------------------------------------- public API
def matmul(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
           activation: str | None = None, out_dtype=None, backend: str = "auto",
           config: MatmulConfig | dict | None = None, transpose_b: bool = False,
           save_preactivation: bool = False) -> jax.Array:
    """Fused `activation(a @ b + bias)` with f32 accumulation, differentiable.

    Args:
        a: (..., M, K) bfloat16, float16 or float32 (float32 is rounded to bfloat16).
        b: (K, N), same dtype as `a`.
        bias: optional (N,) floating-point vector added in f32 before the activation.
        activation: None, "gelu" (tanh approximation), "relu" or "silu".
        out_dtype: result dtype (bfloat16, float16 or float32); default `a.dtype`.
        backend: one of "auto", "mosaic_gpu", "triton", "pallas_tpu", "interpret", "xla".
            "auto" takes the platform's kernel backend, or XLA's dot where none runs or,
            without a `config`, where `autotune` timed XLA's dot faster on this exact
            (M, N, K) and layout (then the whole call, backward included, runs XLA's dot).
        config: a `MatmulConfig` (or dict of its fields) overriding the autotuned
            or shipped tiling; used for the backward matmuls too.
        transpose_b: `b` is (N, K) and the product is `a @ b.T` (a tied embedding
            as the LM head). Mosaic GPU and Triton read `b` as stored, forward and backward;
            the other backends multiply a transposed copy.
        save_preactivation: under differentiation, keep Z = a @ b + bias (in
            `out_dtype`) for the activation's backward instead of recomputing it with one
            more matmul: M x N more residual memory per call, one matmul less per
            backward. On triton, and on mosaic_gpu without `transpose_b`, the forward
            kernel writes Z next to activation(Z) (cuBLASLt's GELU_AUX); elsewhere the
            kernel writes Z in f32 and XLA applies the activation. Needs an activation.
            The forward value does not change; the activation's derivative is taken at Z
            rounded to `out_dtype`, in f32.

    Returns:
        (..., M, N) array of `out_dtype`.

    Differentiation is reverse-mode (a `jax.custom_vjp`), to any order: `jax.grad`,
    `jax.vjp`, `jax.jacrev` and their nestings (grad of grad, also through `lax.scan`), every
    backend. Forward mode (`jax.jvp`, `jax.jacfwd`, `jax.hessian`, which is jacfwd of jacrev)
    raises JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function": take a
    Hessian as `jax.jacrev(jax.jacrev(f))`. The backward's products read dZ rounded to the
    compute dtype (as XLA's bf16 products do), so a second derivative matches the
    full-precision reference within that rounding.

    Example:
        >>> a = jnp.ones((4, 8), jnp.bfloat16); b = jnp.ones((8, 2), jnp.bfloat16)
        >>> matmul(a, b, backend="xla", out_dtype=jnp.float32)[0, 0].item()
        8.0
    """
    for name, flag in (("transpose_b", transpose_b), ("save_preactivation", save_preactivation)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool; got {flag!r}")
    compute, out_dtype = _check_inputs(a, b, bias, activation, out_dtype, transpose_b)
    if save_preactivation and activation is None:
        raise ValueError("save_preactivation=True needs an activation (gelu, relu, silu): "
                         "without one the pre-activation is the output itself")
    from jaxopt_train.kernels.matmul_vjp import _matmul_2d  # noqa: PLC0415 (it imports this module)

    config = as_config(config)
    requested, backend = backend, resolve_backend(backend)
    # Inside shard_map with varying-axes checking, a replicated `b` times a per-device `a`
    # gives a per-device dB, which a custom VJP may not return for an invariant `b`: cast
    # the operands to vary alike first (differentiating the cast psums dB back, as jnp.dot's
    # own gradient does). A no-op elsewhere.
    a, b, bias = to_varying((a, b, bias), varying_axes_of_tree((a, b, bias)))
    if 0 in a.shape or 0 in b.shape:  # no tile to launch: the epilogue of an empty (K=0: zero) product
        return _empty_matmul(a.astype(compute), b.astype(compute), bias, activation, out_dtype, transpose_b)
    # A config given is a tiling asked for: the kernel runs it.
    if (requested == "auto" and config is None and backend != "xla"
            and auto_prefers_xla(backend, a, b, compute, transpose_b)):
        backend = "xla"
    if backend == "xla":  # N-D: no reshape (see `matmul_vjp._xla_products`)
        return _matmul_2d(a.astype(compute), b.astype(compute), bias, activation, out_dtype,
                          backend, config, transpose_b, save_preactivation)
    _check_unsharded(backend, a=a, b=b, bias=bias)
    if pallas_refuses_here(a, backend):  # say so here, not with pallas_call's internal message
        raise ValueError(f"matmul backend {backend!r} runs a BlockSpec pallas_call, which "
                         f"jax.shard_map refuses while it checks varying axes (check_vma=True, "
                         f"its default); got a call inside shard_map over manual axes "
                         f"{tuple(jax.sharding.get_abstract_mesh().manual_axes)}: pass check_vma=False to "
                         f"shard_map, use backend='xla', or use kernels.dot_general, which "
                         f"leaves this case to XLA")
    batch_shape, k, n = a.shape[:-1], a.shape[-1], b.shape[0 if transpose_b else 1]
    a2 = a.reshape(int(np.prod(batch_shape)), k).astype(compute)
    out = _matmul_2d(a2, b.astype(compute), bias, activation, out_dtype, backend, config,
                     transpose_b, save_preactivation)
    return out.reshape(*batch_shape, n)


def auto_prefers_xla(backend: str, a, b, compute, transpose_b: bool) -> bool:
    """Whether `autotune` timed XLA's dot faster than every `backend` config on this exact
    (M, N, K) and layout on this device (a shape-blind "auto" took the kernel on Hopper's
    small and odd shapes, where it runs at 0.68-0.87x XLA's dot: BENCHMARKS.md)."""
    from jaxopt_train.kernels.autotune_cache import xla_is_faster  # noqa: PLC0415

    m, k = int(np.prod(a.shape[:-1])), a.shape[-1]
    n = b.shape[0 if transpose_b else 1]
    # Backends that multiply a transposed copy run (and are tuned in) the plain layout.
    transposed = "b" if transpose_b and backend in TRANSPOSING_BACKENDS else None
    if not xla_is_faster(backend, _device_kind(), m, n, k, compute, transposed):
        return False
    logger.debug("matmul backend auto -> xla for %dx%dx%d%s: autotune timed XLA's dot faster "
                 "than every %s config there", m, n, k, " (b^T)" if transposed else "", backend)
    return True


def _empty_matmul(a, b, bias, activation, out_dtype, transpose_b):
    """`matmul` where M, N or K is 0, by plain jnp (autodiff differentiates it): with K = 0
    the output is the epilogue of zeros, e.g. gelu(bias), as `jnp.dot` gives zeros. Widened
    to f32 first (exact): XLA:CPU runs no bf16 x bf16 -> f32 dot with a transposed operand."""
    rhs = b.T if transpose_b else b
    acc = jnp.matmul(a.astype(jnp.float32), rhs.astype(jnp.float32))
    return apply_epilogue(acc, bias, activation).astype(out_dtype)


def matmul_reference(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
                     activation: str | None = None, out_dtype=None) -> jax.Array:
    """Plain-jnp reference of `matmul`: same rounding rule, dot at Precision.HIGHEST.

    The activations come from `jax.nn` (not the kernels' epilogue) so the
    reference is independent of the code under test.
    """
    compute, out_dtype = _check_inputs(a, b, bias, activation, out_dtype)
    a32 = a.astype(compute).astype(jnp.float32)
    b32 = b.astype(compute).astype(jnp.float32)
    z = jnp.dot(a32, b32, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    reference_activations = {None: lambda x: x, "gelu": functools.partial(jax.nn.gelu, approximate=True),
                             "relu": jax.nn.relu, "silu": jax.nn.silu}
    return reference_activations[activation](z).astype(out_dtype)
