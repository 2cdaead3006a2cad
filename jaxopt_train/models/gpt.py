"""A GPT-2 style decoder-only language model in Flax NNX.

Design choices (each one a knob the trainer and the benchmarks turn):

* Pre-LayerNorm blocks, learned token + position embeddings, GELU MLP, no
  dropout (the pre-training regime we measure does not use it).
* Attention goes through `jax.nn.dot_product_attention` so that
  ``attention="cudnn"`` selects cuDNN flash attention on GPU, ``"xla"`` the
  plain XLA softmax(QK^T)V, and ``"auto"`` lets JAX choose.
* Every dense layer (q/k/v, attention output, MLP, and the LM head, tied or
  not) multiplies through ``config.dot_general`` so a custom matmul kernel can
  be swapped in without touching the model.
* ``dtype`` is the compute dtype and ``param_dtype`` the storage dtype of every
  layer. LayerNorm always runs in float32 (its mean/variance in bf16 lose too
  much) and its output is cast back to ``dtype``; the residual stream is kept
  in ``dtype``.
* The logits come out in ``dtype`` (a bf16 [B, T, 50304] tensor is half the
  memory of an f32 one); `gpt_loss` upcasts them to float32.
* ``tie_embeddings=True`` (the default, as GPT-2/nanoGPT) reuses the token
  embedding as the output head; ``False`` adds a separate bias-free head.
* ``remat`` wraps each block in `nnx.remat` with a named policy and
  ``scan_layers`` stacks the blocks (built with `nnx.vmap`, run with
  `nnx.scan`) so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxopt_train.models.losses import check_ids_in_range
from jaxopt_train.models.losses import gpt_loss as gpt_loss
from jaxopt_train.models.losses import softmax_cross_entropy as softmax_cross_entropy

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
REMAT_POLICIES = ("none", "dots", "full")

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
# Every dense layer's output carries this name, so remat="dots" can save it even
# when a custom dot_general (a Pallas or Triton kernel, not a `dot_general`
# primitive) computes it: `dots_with_no_batch_dims_saveable` alone saved nothing
# there, and "dots" silently became "full".
DENSE_OUTPUT_NAME = "gpt_dense_output"


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
        needs a GPU, bf16/f16 compute and head_dim % 8 == 0, head_dim <= 256;
        past 128 only on Hopper (sm90) or newer, as JAX checks when tracing).
        An odd sequence length is padded by one position for cuDNN, whose
        backward refuses odd lengths; causal masking makes the pad exact.
      remat: Per-block rematerialisation: "none", "dots" (save the output of
        every dense layer, whatever `dot_general` computes it, and other matmul
        outputs without batch dims; recompute the rest) or "full" (save nothing).
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
    if name not in _PRESETS:
        raise ValueError(f"name={name!r} is not a GPT preset; legal values: {GPT_PRESETS}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; legal fields: {sorted(fields)}")
    return GPTConfig(**{**_PRESETS[name], **overrides})


def _remat_policy(name: str):
    if name == "dots":
        policies = jax.checkpoint_policies
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable,
            policies.save_only_these_names(DENSE_OUTPUT_NAME),
        )
    return None  # "full": nothing saveable, everything recomputed in the backward pass.


def _attention_implementation(name: str) -> str | None:
    if name == "auto":
        return None
    if name == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"attention='cudnn' needs a CUDA GPU but the default backend is "
            f"{jax.default_backend()!r}; use attention='auto' or 'xla'"
        )
    return name


class _Dense(nnx.Linear):
    """`nnx.Linear` with the GPT init and the injected dot_general."""

    def __init__(self, cfg: GPTConfig, d_in: int, d_out: int, *, std: float, rngs: nnx.Rngs):
        super().__init__(
            d_in,
            d_out,
            use_bias=cfg.use_bias,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nnx.initializers.normal(std),
            dot_general=cfg.dot_general or jax.lax.dot_general,
            rngs=rngs,
        )

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return checkpoint_name(super().__call__(inputs), DENSE_OUTPUT_NAME)

    def column_blocks(self, inputs: jax.Array, parts: int) -> list[jax.Array]:
        """``self(inputs)`` split into ``parts`` equal column blocks, each from its own product.

        Slicing one wide product's output makes XLA copy each block out (they are
        strided in memory); multiplying by the kernel's column blocks instead writes
        each result contiguous, at the price of ``parts`` narrower GEMMs.
        """
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        width, rem = divmod(kernel.shape[-1], parts)
        if rem:
            raise ValueError(f"{kernel.shape[-1]} output columns do not split into {parts} blocks")
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        dims = (((inputs.ndim - 1,), (0,)), ((), ()))
        blocks = []
        for i in range(parts):
            cols = slice(i * width, (i + 1) * width)
            y = self.dot_general(inputs, kernel[:, cols], dims, precision=self.precision)
            y = y if bias is None else y + bias[cols]
            blocks.append(checkpoint_name(y, DENSE_OUTPUT_NAME))
        return blocks


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        cfg.d_model,
        epsilon=cfg.layer_norm_epsilon,
        dtype=jnp.float32,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention through `jax.nn.dot_product_attention`."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.qkv = _Dense(cfg, cfg.d_model, 3 * cfg.d_model, std=cfg.init_std, rngs=rngs)
        self.out = _Dense(cfg, cfg.d_model, cfg.d_model, std=out_std, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, _ = x.shape
        cfg = self.cfg
        if cfg.split_qkv:
            heads = (batch, length, cfg.n_heads, cfg.head_dim)
            q, k, v = (y.reshape(heads) for y in self.qkv.column_blocks(x, 3))
        else:
            qkv = self.qkv(x).reshape(batch, length, 3, cfg.n_heads, cfg.head_dim)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        implementation = _attention_implementation(cfg.attention)
        # cuDNN's backward refuses an odd length ("Unsupported sequence length Q 17,
        # KV 17" on an H200). One zero position appended at the end changes nothing
        # before it under the causal mask, and its output is dropped.
        pad = length % 2 if implementation == "cudnn" else 0
        y = causal_attention(*(_pad_time(a, pad) for a in (q, k, v)), implementation)
        return self.out(y[:, :length].reshape(batch, length, cfg.d_model))


def _pad_time(x: jax.Array, pad: int) -> jax.Array:
    return x if not pad else jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     implementation: str | None) -> jax.Array:
    """Causal `jax.nn.dot_product_attention` of [batch, time, heads, head_dim] q, k, v."""
    # jax's XLA attention promotes bf16 against a float32 constant, which
    # strict dtype promotion (our tests, careful users) rejects. Its backward, a
    # dot of an f32 cotangent with bf16, is checked when the step is lowered, which
    # no block here can cover: compile a bf16 model with XLA attention under
    # "standard" too (tests/test_train.py).
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class MLP(nnx.Module):
    """Two dense layers with a tanh-approximated GELU between them (GPT-2)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.fuse = cfg.fuse_mlp_activation
        self.fc = _Dense(cfg, cfg.d_model, cfg.mlp_dim, std=cfg.init_std, rngs=rngs)
        self.proj = _Dense(cfg, cfg.mlp_dim, cfg.d_model, std=out_std, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dot = self.fc.dot_general
        fused = getattr(dot, "fused_dense", None)
        if self.fuse is None:  # the default: only where the kernel applies the GELU (measured)
            fused = fused if getattr(dot, "fuses_in_one_launch", lambda: False)() else None
        elif not self.fuse:
            fused = None
        if fused is not None:
            # nnx.Linear's own promotion: inputs, kernel and bias in the compute dtype.
            dtype = self.fc.dtype
            bias = None if self.fc.bias is None else self.fc.bias[...].astype(dtype)
            h = fused(x.astype(dtype), self.fc.kernel[...].astype(dtype), bias, "gelu")
            if h is not None:
                return self.proj(checkpoint_name(h, DENSE_OUTPUT_NAME))
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        self.ln1 = _layer_norm(cfg, rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = _layer_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x).astype(self.dtype))
        return x + self.mlp(self.ln2(x).astype(self.dtype))


def _apply_block(block: Block, x: jax.Array, remat: str, prevent_cse: bool) -> jax.Array:
    if remat == "none":
        return block(x)
    call = nnx.remat(
        lambda blk, y: blk(y), policy=_remat_policy(remat), prevent_cse=prevent_cse
    )
    return call(block, x)


class GPT(nnx.Module):
    """Decoder-only transformer language model.

    Example:
      >>> from flax import nnx
      >>> cfg = get_gpt_config("gpt-tiny", n_layers=1)
      >>> model = GPT(cfg, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
        cfg = self.config = config
        embed_init = nnx.initializers.normal(cfg.init_std)
        self.wte = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=embed_init, rngs=rngs,
        )
        self.wpe = nnx.Embed(
            cfg.seq_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=embed_init, rngs=rngs,
        )
        if cfg.scan_layers:
            self.blocks = _stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _layer_norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                param_dtype=cfg.param_dtype, kernel_init=embed_init,
                dot_general=cfg.dot_general or jax.lax.dot_general, rngs=rngs,
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Maps int tokens [B, T] (T <= seq_len) to logits [B, T, vocab] in ``dtype``."""
        return self.logits_from_embeddings(self.embed(tokens))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token plus position embeddings [B, T, d_model]: the input of the first block.

        `model(tokens) == model.logits_from_embeddings(model.embed(tokens))`; the split
        lets a data-parallel step differentiate w.r.t. these activations and exchange the
        lookup's gradient as rows (`collectives.embedding_grad_exchange`)."""
        tokens = self._check_tokens(tokens)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        # A negative id would wrap round to a real row (jnp.take); moved out of range it
        # gives a NaN row instead, as ids >= vocab_size already do, so the loss shows it.
        tokens = jnp.where(tokens < 0, self.config.vocab_size, tokens)
        return self.wte(tokens) + self.wpe(positions)[None]

    def _check_tokens(self, tokens) -> jax.Array:
        cfg = self.config
        if not hasattr(tokens, "ndim"):  # a nested list: say what it holds, not "no .ndim"
            tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer array [batch, time], got shape={tokens.shape} "
                f"dtype={tokens.dtype}"
            )
        # Checked here, not only in __call__: past seq_len the position lookup gives
        # NaN rows (jnp.take's fill mode), silently, to a caller of `embed`.
        if tokens.shape[1] > cfg.seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds config seq_len={cfg.seq_len}"
            )
        check_ids_in_range(tokens, cfg.vocab_size, "tokens")
        return tokens

    def logits_from_embeddings(self, x: jax.Array) -> jax.Array:
        """The blocks, final LayerNorm and head applied to embeddings [B, T, d_model]."""
        cfg = self.config
        x = self._run_blocks(x)
        x = self.ln_f(x).astype(cfg.dtype)
        if cfg.tie_embeddings:
            return self._tied_logits(x)
        return self.head(x)

    def _run_blocks(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        if not cfg.scan_layers:
            for block in self.blocks:
                x = _apply_block(block, x, cfg.remat, prevent_cse=True)
            return x

        # Inside scan the loop already stops XLA from CSE-ing the recomputation.
        def body(carry, block):
            return _apply_block(block, carry, cfg.remat, prevent_cse=False), None

        x, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, self.blocks)
        return x

    def _tied_logits(self, x: jax.Array) -> jax.Array:
        # x @ embedding.T contracted on the embedding's dim 1 rather than on a
        # transposed copy: XLA's dot and our matmul kernel (transpose_b) both read
        # the [vocab, d_model] table as stored, forward and backward. With an
        # explicit `.T` the kernel path paid ~2.7 ms/step of transposes on gpt-1b.
        cfg = self.config
        embedding = self.wte.embedding[...].astype(cfg.dtype)
        dot_general = cfg.dot_general or jax.lax.dot_general
        return dot_general(x, embedding, (((x.ndim - 1,), (1,)), ((), ())), precision=None)


def _stacked_blocks(cfg: GPTConfig, rngs: nnx.Rngs) -> Block:
    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=layer_rngs)

    return make(rngs)


def warn_if_cudnn_unavailable(cfg: GPTConfig) -> GPTConfig:
    """Returns ``cfg`` with attention="xla" (and a warning) when cuDNN cannot run here."""
    if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
        warnings.warn(
            f"attention='cudnn' needs a CUDA GPU; backend is {jax.default_backend()!r}, "
            "falling back to attention='xla'",
            stacklevel=2,
        )
        return dataclasses.replace(cfg, attention="xla")
    return cfg
