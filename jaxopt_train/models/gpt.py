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
* ``remat`` wraps each block in `nnx.remat` with a named policy ("dots"
  saves the matmul outputs, "dots_attention" the attention's forward results
  too, so cuDNN's flash attention is not run twice) and
  ``scan_layers`` stacks the blocks (built with `nnx.vmap`, run with
  `nnx.scan`) so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxopt_train.models.embedding import Embed, embedding_lookup
from jaxopt_train.models.gpt_config import ATTENTION_IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from jaxopt_train.models.gpt_config import CUDNN_MAX_HEAD_DIM as CUDNN_MAX_HEAD_DIM
from jaxopt_train.models.gpt_config import GPT_PRESETS as GPT_PRESETS
from jaxopt_train.models.gpt_config import REMAT_POLICIES as REMAT_POLICIES
from jaxopt_train.models.gpt_config import GPTConfig as GPTConfig
from jaxopt_train.models.gpt_config import canonical_dtype as canonical_dtype
from jaxopt_train.models.gpt_config import get_gpt_config as get_gpt_config
from jaxopt_train.models.losses import check_ids_in_range
from jaxopt_train.models.losses import gpt_loss as gpt_loss
from jaxopt_train.models.losses import softmax_cross_entropy as softmax_cross_entropy

# Every dense layer's output carries this name, so remat="dots" can save it even
# when a custom dot_general (a Pallas or Triton kernel, not a `dot_general`
# primitive) computes it: `dots_with_no_batch_dims_saveable` alone saved nothing
# there, and "dots" silently became "full".
DENSE_OUTPUT_NAME = "gpt_dense_output"
# The attention's output [batch, time, heads, head_dim], saved by remat="dots_attention".
ATTENTION_OUTPUT_NAME = "gpt_attention_output"
# The primitives of cuDNN flash attention's forward in JAX (the custom_vjp's forward
# rule binds the wrapper). Saving their results (the output and the softmax
# statistics, the backward's residuals) is what stops "dots" from running the
# whole attention forward a second time in the backward pass.
_CUDNN_ATTENTION_FORWARD = frozenset({"dot_product_attention_fwd_wrapper",
                                      "dot_product_attention_fwd"})


def _saves_cudnn_attention_forward(prim, *_, **__) -> bool:
    return prim.name in _CUDNN_ATTENTION_FORWARD


def _remat_policy(name: str):
    policies = jax.checkpoint_policies
    dots = policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable,
        policies.save_only_these_names(DENSE_OUTPUT_NAME),
    )
    if name == "dots":
        return dots
    if name == "dots_attention":
        attention = policies.save_from_both_policies(
            policies.save_only_these_names(ATTENTION_OUTPUT_NAME), _saves_cudnn_attention_forward)
        return policies.save_from_both_policies(dots, attention)
    return None  # "full": nothing saveable, everything recomputed in the backward pass.


# cuDNN's fused attention runs on Ampere (sm_80) and newer only (cuDNN's attention support
# matrix). JAX checks the head_dim but not the GPU: on a T4 (7.5) it failed inside XLA.
CUDNN_MIN_CAPABILITY = (8, 0)


def cudnn_attention_unavailable() -> str | None:
    """Why cuDNN attention cannot run on every device of this process, or None when it can."""
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    if jax.default_backend() != "gpu":
        return f"needs a CUDA GPU but the default backend is {jax.default_backend()!r}"
    # This process's GPUs: what another host's report of its devices holds is not ours to
    # rely on, and the hosts of one job run one kind of GPU. An unreadable one is (0, 0).
    oldest = min(jax.local_devices(), key=compute_capability)
    if compute_capability(oldest) < CUDNN_MIN_CAPABILITY:
        return (f"needs an NVIDIA Ampere or newer GPU (compute capability >= 8.0) but "
                f"{oldest.device_kind} has compute_capability="
                f"{getattr(oldest, 'compute_capability', None)!r}")
    return None


def _attention_implementation(name: str) -> str | None:
    if name == "auto":
        return None
    why = cudnn_attention_unavailable() if name == "cudnn" else None
    if why:
        raise ValueError(f"attention='cudnn' {why}; use attention='auto' or 'xla'")
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
        y = checkpoint_name(y, ATTENTION_OUTPUT_NAME)
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
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU cannot compile the backward's fp16 dot ("The precision 'F16_F16_F32' is
        # not supported by dot_general on CPU"): there an fp16 model attends in f32.
        return causal_attention(*(a.astype(jnp.float32) for a in (q, k, v)), implementation).astype(q.dtype)
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
        # Our Embed, though `embed` reads the tables itself: a direct `model.wte(ids)` sums
        # its gradient in f32 too, and the Trainer has no 16-bit nnx.Embed to warn about.
        self.wte = Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=embed_init, rngs=rngs,
        )
        self.wpe = Embed(
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
        # The token rows come out in f32 with their gradient summed in f32 (nnx.Embed's is
        # a scatter-add in the compute dtype, which in bf16 lost a frequent token's rows and
        # ran slower as training went on: models/embedding.py). Any id outside [0, vocab),
        # a negative one or a uint32 past int32 included, gives a NaN row: the loss shows
        # it. The positions are 0..T-1, so theirs is a slice, and the two are added in f32:
        # the position table's gradient is then an f32 sum over the batch too.
        rows = embedding_lookup(self.wte.embedding[...], tokens, jnp.float32)
        positions = self.wpe.embedding[...][: tokens.shape[1]].astype(jnp.float32)
        return (rows + positions[None]).astype(self.config.dtype)

    def _check_tokens(self, tokens) -> jax.Array:
        cfg = self.config
        if not hasattr(tokens, "ndim"):  # a nested list: say what it holds, not "no .ndim"
            tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer array [batch, time], got shape={tokens.shape} "
                f"dtype={tokens.dtype}"
            )
        # Checked here, not only in __call__: past seq_len there are no position rows,
        # and a caller of `embed` gets this message rather than a broadcasting error.
        if tokens.shape[1] > cfg.seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds config seq_len={cfg.seq_len}"
            )
        check_ids_in_range(tokens, cfg.vocab_size, "tokens")
        return tokens

    def logits_from_embeddings(self, x: jax.Array) -> jax.Array:
        """The blocks, final LayerNorm and head applied to embeddings [B, T, d_model]."""
        cfg = self.config
        # Public on its own (a data-parallel step feeds it): a wrong shape otherwise failed
        # deep inside attention ("cannot reshape ...", "not enough values to unpack").
        if (getattr(x, "ndim", None) != 3 or x.shape[-1] != cfg.d_model
                or not jnp.issubdtype(x.dtype, jnp.floating)):
            raise ValueError(
                f"embeddings must be a floating array [batch, time, d_model={cfg.d_model}] "
                f"(e.g. model.embed(tokens)), got shape={getattr(x, 'shape', None)} "
                f"dtype={getattr(x, 'dtype', type(x).__name__)}")
        x = self._run_blocks(x)
        x = self.ln_f(x).astype(cfg.dtype)
        if cfg.tie_embeddings:
            return self._tied_logits(x)
        return self.head(x)

    def _run_blocks(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        if not cfg.scan_layers:
            covered = cfg.n_layers if cfg.remat_layers is None else cfg.remat_layers
            for i, block in enumerate(self.blocks):
                x = _apply_block(block, x, cfg.remat if i < covered else cfg.remat_rest,
                                 prevent_cse=True)
            return x

        # Inside scan the loop already stops XLA from CSE-ing the recomputation.
        # (remat_layers is None, 0 or n_layers and remat_rest "none" here: GPTConfig
        # refuses the others.)
        remat = "none" if cfg.remat_layers == 0 else cfg.remat

        def body(carry, block):
            return _apply_block(block, carry, remat, prevent_cse=False), None

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
    why = cudnn_attention_unavailable() if cfg.attention == "cudnn" else None
    if why:
        warnings.warn(f"attention='cudnn' {why}; falling back to attention='xla'", stacklevel=2)
        return dataclasses.replace(cfg, attention="xla")
    return cfg
