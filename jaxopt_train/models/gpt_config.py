"""`GPTConfig`: the GPT model's shape, dtypes and knobs, checked when built, and its presets.

Separate from the model (`jaxopt_train.models.gpt`) so that code which only reads a
configuration (FLOP counts, the trainer's and the bench's flag checks) can build one.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxopt_train._checks import is_int

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
REMAT_POLICIES = ("none", "dots_attention", "dots", "full")

_DTYPE_ALIASES = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
}
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 256


def _positive_int(name: str, value: Any) -> int:
    """`value` as a Python int >= 1; numpy integers count (e.g. a vocab from data), bools not."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return number


def _positive_float(name: str, value: Any) -> float:
    """`value` as a finite Python float > 0; numpy floats count, bools and strings not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def canonical_dtype(value: Any, name: str) -> jnp.dtype:
    """Returns ``value`` as a floating `jnp.dtype`, accepting "bf16"-style aliases."""
    if isinstance(value, str) and value.lower() in _DTYPE_ALIASES:
        value = _DTYPE_ALIASES[value.lower()]
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(
            f"{name}={value!r} is not a dtype; use one of {sorted(_DTYPE_ALIASES)}"
        ) from err
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}={value!r} must be float32, bfloat16 or float16")
    return dtype


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and execution options of a `GPT`.

    Attributes:
      vocab_size: Number of token ids; logits have this last dimension.
      seq_len: Maximum sequence length (size of the position embedding).
      d_model: Residual stream width.
      n_layers: Number of transformer blocks.
      n_heads: Attention heads; must divide ``d_model``.
      mlp_ratio: MLP hidden width is ``mlp_ratio * d_model``.
      dtype: Compute dtype of every layer (LayerNorm excepted, see module doc).
      param_dtype: Storage dtype of the parameters.
      attention: "auto" (JAX picks), "xla", or "cudnn" (GPU flash attention;
        needs an Ampere (sm80) or newer GPU, bf16/f16 compute and head_dim % 8 == 0,
        head_dim <= 256; past 128 only on Hopper (sm90) or newer; the GPU is
        checked when tracing).
        An odd sequence length is padded by one position for cuDNN, whose
        backward refuses odd lengths; causal masking makes the pad exact.
      remat: Per-block rematerialisation: "none", "dots" (save the output of
        every dense layer, whatever `dot_general` computes it, and other matmul
        outputs without batch dims; recompute the rest), "dots_attention" (as
        "dots", and the attention's output, plus cuDNN's softmax statistics:
        the backward then never reruns the attention forward, for one
        [batch, time, d_model] tensor more per block) or "full" (save nothing).
      remat_layers: How many blocks, from the first, run under `remat`; the
        others keep every activation. None: all of them. Memory grows by about
        one block's activations per block left out, so a budget that "none"
        misses by a little needs only a few blocks recomputed (blocks unrolled:
        a scan runs every block under one policy).
      remat_rest: The policy of the blocks past `remat_layers` ("none": they keep
        every activation). A lighter policy than `remat` there, e.g. "full" on
        the first 3 blocks and "dots" on the rest, meets a budget with less
        recompute than "full" on more blocks and none on the rest. Needs
        `remat_layers` (and so unrolled blocks).
      scan_layers: Stack the blocks and run them with `nnx.scan`.
      split_qkv: Compute q, k and v as three products from column blocks of the
        one fused qkv weight instead of one product sliced three ways. Same
        parameters and the same math; each of q, k, v then leaves its own GEMM
        contiguous, so cuDNN attention reads them without the slice copies
        (and the backward needs no concatenation of dq, dk, dv). On gpt-1b on an
        H200 the three narrower GEMMs cost more than the copies (1.5% slower).
      dot_general: Replacement for `jax.lax.dot_general` in every dense layer;
        None uses `jax.lax.dot_general`.
      fuse_mlp_activation: When `dot_general` offers `fused_dense` (those of
        `jaxopt_train.kernels.make_dot_general` do), the MLP's first layer, its
        bias and the GELU run as one kernel launch that also writes the
        pre-activation for the backward, so no separate pass reads the layer's
        output to apply the GELU. No effect with XLA's dot_general. None (the
        default) fuses where the kernel applies the GELU itself
        (`dot_general.fuses_in_one_launch()`: Mosaic GPU and Triton): on gpt-1b
        on an H200 that needs 2.0 GiB less memory (XLA's own GELU keeps both Z
        and its tanh for the backward) and the step is as fast or slightly
        faster (same process; Mosaic GPU, fifteenth session: 90.16 and 89.57 ms
        against 90.26 ms unfused; Triton, seventeenth: 92.86 against 93.08 ms;
        BENCHMARKS.md). True also takes the other kernels' path
        (Z from the kernel, the GELU by XLA, Z kept: not measured for speed);
        False never fuses.
      tie_embeddings: Use the token embedding as the output head.
      use_bias: Biases in the dense layers (LayerNorm always has one).
      layer_norm_epsilon: LayerNorm epsilon.
      init_std: Std of the normal init of weights and embeddings; residual
        output projections use ``init_std / sqrt(2 * n_layers)`` (GPT-2).
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention: str = "auto"
    remat: str = "none"
    remat_layers: int | None = None
    remat_rest: str = "none"
    scan_layers: bool = False
    split_qkv: bool = False
    dot_general: Callable[..., jax.Array] | None = None
    fuse_mlp_activation: bool | None = None
    tie_embeddings: bool = True
    use_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "dtype"))
        object.__setattr__(
            self, "param_dtype", canonical_dtype(self.param_dtype, "param_dtype")
        )
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention={self.attention!r}; legal values: {ATTENTION_IMPLEMENTATIONS}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; legal values: {REMAT_POLICIES}")
        self._check_remat_layers()
        for name in ("scan_layers", "split_qkv", "fuse_mlp_activation", "tie_embeddings",
                     "use_bias"):
            value = getattr(self, name)
            if name == "fuse_mlp_activation" and value is None:
                continue  # None: fuse where the kernel applies the activation itself
            if not isinstance(value, bool):
                allowed = "True, False or None" if name == "fuse_mlp_activation" else "True or False"
                raise ValueError(f"{name}={value!r} must be {allowed}")
        if self.dot_general is not None and not callable(self.dot_general):
            raise ValueError(f"dot_general={self.dot_general!r} must be callable or None")
        for name in ("layer_norm_epsilon", "init_std"):  # NaN logits otherwise, with no message
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        if self.attention == "cudnn":
            self._check_cudnn()

    def _check_cudnn(self):
        # cuDNN's fused attention rejects these at lowering time with an opaque error.
        if self.dtype == jnp.float32:
            raise ValueError(
                "attention='cudnn' needs dtype bfloat16 or float16, got dtype=float32; "
                "use attention='xla' or 'auto' for float32"
            )
        # 256 is cuDNN's limit on Hopper and newer; older GPUs stop at 128, which JAX
        # itself reports when tracing (it needs the device, this config does not).
        if self.head_dim % 8 or self.head_dim > CUDNN_MAX_HEAD_DIM:
            raise ValueError(
                f"attention='cudnn' needs head_dim % 8 == 0 and head_dim <= "
                f"{CUDNN_MAX_HEAD_DIM} (<= 128 before Hopper), got head_dim={self.head_dim} "
                f"(d_model={self.d_model}, n_heads={self.n_heads}); use attention='xla'"
            )

    def _check_remat_layers(self) -> None:
        layers = self.remat_layers
        if self.remat_rest not in REMAT_POLICIES:
            raise ValueError(f"remat_rest={self.remat_rest!r}; legal values: {REMAT_POLICIES}")
        if self.remat_rest != "none" and layers is None:
            raise ValueError(f"remat_rest={self.remat_rest!r} is the policy of the blocks past "
                             "remat_layers, but remat_layers is None (remat on every block); "
                             "set remat_layers=k")
        if layers is None:
            return
        if not is_int(layers) or not 0 <= layers <= self.n_layers:
            raise ValueError(f"remat_layers={layers!r} must be None (every block) or an int from 0 "
                             f"to n_layers={self.n_layers}")
        object.__setattr__(self, "remat_layers", int(layers))
        if self.remat_rest != "none" and self.scan_layers:
            raise ValueError(f"remat_rest={self.remat_rest!r} needs scan_layers=False: a scan "
                             "runs every block under one policy")
        if layers and self.remat == "none":
            raise ValueError(f"remat_layers={layers} names blocks to rematerialise, but remat='none'; "
                             "set remat='dots_attention', 'dots' or 'full'")
        if self.scan_layers and 0 < layers < self.n_layers:
            raise ValueError(f"remat_layers={layers} of n_layers={self.n_layers} needs "
                             "scan_layers=False: a scan runs every block under one policy")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.d_model


_PRESETS: dict[str, dict[str, int]] = {
    # Byte-level, trains in seconds on a CPU.
    "gpt-tiny": dict(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4),
    # GPT-2 small/medium shapes with the vocab padded to a multiple of 128.
    "gpt-124m": dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    "gpt-350m": dict(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "gpt-1b": dict(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, n_heads=16),
    # For memory planning (does not fit one 141 GB GPU with Adam in f32).
    "gpt-7b": dict(vocab_size=50304, seq_len=2048, d_model=4096, n_layers=32, n_heads=32),
}
GPT_PRESETS = tuple(_PRESETS)


def get_gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """Returns the preset ``name`` with ``overrides`` applied and validated.

    Args:
      name: One of `GPT_PRESETS`.
      **overrides: Any `GPTConfig` field, e.g. ``dtype="bf16", remat="dots"``.

    Raises:
      ValueError: unknown preset or field, or an illegal value.
    """
    # A list or dict name is unhashable: the membership test would raise "unhashable type".
    if not isinstance(name, str) or name not in _PRESETS:
        raise ValueError(f"name={name!r} is not a GPT preset; legal values: {GPT_PRESETS}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; legal fields: {sorted(fields)}")
    return GPTConfig(**{**_PRESETS[name], **overrides})
