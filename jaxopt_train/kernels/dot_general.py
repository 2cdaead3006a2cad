"""A drop-in `dot_general` for Flax layers that routes dense matmuls to our kernels.

`nnx.Linear(..., dot_general=make_dot_general("mosaic_gpu"))` or
`linen.Dense(..., dot_general=...)`. Flax calls
`dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=None,
out_sharding=None[, preferred_element_type=...])`. That pattern, with both
operands in bfloat16 or float16, goes to `matmul`, and so does a 2-D `rhs`
contracted on its dim 1 (`x @ embedding.T`, a tied LM head: `matmul(...,
transpose_b=True)`, which reads it without a transposed copy); everything else (batch
dims, other contracting dims, float32 or empty operands, an explicit precision or
out_sharding, and on the Pallas BlockSpec backends ("interpret", "pallas_tpu") any call
inside `jax.shard_map` with `check_vma=True`, which their pallas_call refuses) goes to
`lax.dot_general` unchanged, so swapping it in never
changes what a model computes outside the kernels' domain.

The returned function also carries `fused_dense(x, kernel, bias, activation)`: a
dense layer and its activation as one kernel launch that keeps the pre-activation
for the backward (`matmul(..., save_preactivation=True)`), or None where the
kernels do not apply, so a model can fuse its MLP's activation when it is given
one of these functions and run its plain layer otherwise; and
`fuses_in_one_launch()`, True where that activation runs inside the kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxopt_train._typed_sharding import explicit_sharding
from jaxopt_train.kernels.configs import BACKENDS, MatmulConfig, as_config
from jaxopt_train.kernels.matmul import (auto_prefers_xla, matmul, pallas_refuses_here,
                                         resolve_backend, writes_preactivation)

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MATMUL_CHOICES = ("xla", "pallas", "triton")


def _is_default_precision(precision) -> bool:
    """None or DEFAULT, alone or per operand (a tuple or a list), including its string
    spelling "default" and `lax.DotAlgorithmPreset.DEFAULT` (which `lax.dot_general`
    accepts: a user passing them should still get the kernel)."""
    if isinstance(precision, (tuple, list)):
        return all(_is_default_precision(p) for p in precision)
    preset = getattr(lax, "DotAlgorithmPreset", None)
    if preset is not None and isinstance(precision, preset):
        return precision == preset.DEFAULT
    if isinstance(precision, str):
        try:
            precision = lax.Precision(precision)
        except ValueError:
            return False
    return precision is None or precision == lax.Precision.DEFAULT


def _dims(dimension_numbers) -> tuple:
    """((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)), each a tuple, read as
    `lax.dot_general` reads them: an int stands for one dim (`((1, 0), ((), ()))`)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    as_tuple = lambda dims: (dims,) if np.ndim(dims) == 0 else tuple(dims)  # noqa: E731
    return ((as_tuple(lhs_contract), as_tuple(rhs_contract)),
            (as_tuple(lhs_batch), as_tuple(rhs_batch)))


def _kernel_eligible(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                     out_sharding, backend) -> bool:
    if dimension_numbers is None:  # lax.dot picks the dims of <= 2-D operands itself
        return False
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = _dims(dimension_numbers)
    return (rhs.ndim == 2 and lhs.ndim >= 2 and lhs.size > 0 and rhs.size > 0
            and lhs_contract == (lhs.ndim - 1,) and rhs_contract in ((0,), (1,))
            # Unequal K goes to lax, whose TypeError names the dims as the caller wrote them
            # (matmul's ValueError spoke of `a`, `b` and `transpose_b`, which they never passed).
            and lhs.shape[-1] == rhs.shape[rhs_contract[0]]
            and not lhs_batch and not rhs_batch
            and jnp.dtype(lhs.dtype) in _KERNEL_DTYPES and lhs.dtype == rhs.dtype
            and _is_default_precision(precision) and out_sharding is None
            and explicit_sharding(lhs) is None and explicit_sharding(rhs) is None
            and (preferred_element_type is None
                 or jnp.dtype(preferred_element_type) in (*_KERNEL_DTYPES, jnp.dtype(jnp.float32)))
            and not pallas_refuses_here(lhs, backend))


def _dense_eligible(x, kernel, bias) -> bool:
    """Whether `fused_dense`'s operands are in the kernels' domain."""
    return (getattr(kernel, "ndim", 0) == 2 and x.ndim >= 2 and x.size > 0 and kernel.size > 0
            and jnp.dtype(x.dtype) in _KERNEL_DTYPES and x.dtype == kernel.dtype
            and all(explicit_sharding(v) is None for v in (x, kernel, bias) if v is not None))


def make_dot_general(backend: str = "auto", config: MatmulConfig | dict | None = None) -> Callable:
    """Returns a `lax.dot_general`-compatible function backed by `matmul(backend=...)`.

    The backend is resolved on first call (not here: nothing touches devices at
    construction). If it resolves to "xla" the function is `lax.dot_general`; with
    "auto" and no `config`, so is every call on a shape where `autotune` timed XLA's dot
    faster than the kernel (`matmul`'s rule).
    The name and the config are checked here, though: a typo should fail where the
    layer is built, not inside the model's first forward pass.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} is unknown; expected one of {BACKENDS}")
    config = as_config(config)
    state: dict[str, str] = {}

    def resolved() -> str:  # resolved on first use, not when the layer is built
        if "resolved" not in state:
            state["resolved"] = resolve_backend(backend)
        return state["resolved"]

    def tuned_xla(lhs, rhs, transpose_b: bool) -> bool:
        """"auto" without a config only (a config is a tiling asked for): `autotune` timed
        XLA's dot faster than the kernel on this shape."""
        return (backend == "auto" and config is None
                and auto_prefers_xla(resolved(), lhs, rhs, lhs.dtype, transpose_b))

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None, **kwargs):
        if resolved() != "xla" and not kwargs and _kernel_eligible(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding,
                resolved()):
            transpose_b = _dims(dimension_numbers)[0][1] == (1,)
            if not tuned_xla(lhs, rhs, transpose_b):
                return matmul(lhs, rhs, out_dtype=preferred_element_type or lhs.dtype,
                              backend=resolved(), config=config, transpose_b=transpose_b)
        extra = dict(kwargs)
        if out_sharding is not None:
            extra["out_sharding"] = out_sharding
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **extra)

    def fused_dense(x, kernel, bias, activation):
        """`activation(x @ kernel + bias)` from one kernel launch that saves the
        pre-activation for the backward; None where the kernels do not apply (XLA
        resolved, a dtype other than bf16/fp16, a kernel that is not 2-D, an empty operand,
        an operand typed with explicit sharding, a BlockSpec kernel under shard_map's
        varying-axes checking)."""
        if (resolved() == "xla" or not _dense_eligible(x, kernel, bias)
                or pallas_refuses_here(x, resolved()) or tuned_xla(x, kernel, False)):
            return None
        return matmul(x, kernel, bias=bias, activation=activation, backend=resolved(),
                      config=config, save_preactivation=True)

    def fuses_in_one_launch() -> bool:
        """Whether `fused_dense` applies the activation inside the kernel (Mosaic GPU and
        Triton, which write both activation(Z) and Z). The other backends' `fused_dense`
        writes Z from the kernel and lets XLA apply the activation: it keeps less for the
        backward, but its speed was not measured against the plain layer."""
        return writes_preactivation(resolved())

    dot_general.backend = backend
    dot_general.fused_dense = fused_dense
    dot_general.fuses_in_one_launch = fuses_in_one_launch
    return dot_general


dot_general = make_dot_general("auto")
dot_general.__doc__ = "`make_dot_general('auto')`: the platform's fastest matmul kernel, else XLA."


def dot_general_for(choice: str) -> Callable:
    """The dot_general behind a `--matmul xla|pallas|triton` flag.

    "pallas" means the Pallas kernel of the platform: Mosaic GPU on Hopper,
    Mosaic TPU on TPU, interpret mode elsewhere (slow: for tests only).
    """
    if choice not in MATMUL_CHOICES:
        raise ValueError(f"--matmul {choice!r} is unknown; expected one of {MATMUL_CHOICES}")
    if choice == "xla":
        return lax.dot_general
    if choice == "triton":
        return make_dot_general("triton")
    platform = jax.devices()[0].platform
    pallas_backend = {"gpu": "mosaic_gpu", "tpu": "pallas_tpu"}.get(platform, "interpret")
    if pallas_backend == "interpret":
        logger.warning("--matmul pallas on %s runs the Pallas kernel in interpret mode (slow)", platform)
    return make_dot_general(pallas_backend)
