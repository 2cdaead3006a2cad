"""Parameter and FLOP counts used for MFU.

GPT (PaLM appendix B, as nanoGPT's `estimate_mfu`): training FLOPs per token are

    6 * N + 12 * L * d * T

where 6N is forward (2N) plus backward (4N) of every weight matmul and
12*L*d*T is the attention score and value matmuls (QK^T and AV: 2 * 2*T*d
forward per layer, times 3 for training; the causal mask is not discounted).

N counts every parameter that takes part in a matmul once: all block and
final-LayerNorm parameters plus the output-head matrix. Position embeddings
are excluded (a lookup). With tied embeddings the token embedding *is* the
head, so it is counted once; untied, the head is counted and the input token
embedding (a lookup) is not. This is nanoGPT's ``get_num_params()`` choice.
Biases and LayerNorm parameters are in N although they cost no matmul FLOPs
(< 0.1% for every preset).

ResNet: FLOPs are counted from the architecture in `resnet.py` as
2 * multiply-accumulates of every convolution and of the classifier
(BatchNorm, ReLU, pooling and residual adds are ignored, as in the ResNet
paper's "FLOPs" which are multiply-adds: ResNet-50 at 224x224 is 4.1 G MACs,
so ~8.2 GFLOPs forward). Training is 3x the forward pass.
"""

from __future__ import annotations

from jaxopt_train.models.gpt import GPTConfig


def _check_gpt_config(cfg: GPTConfig) -> None:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")


def gpt_param_count(cfg: GPTConfig) -> int:
    """Returns the exact number of parameters of `GPT(cfg)` (all of them)."""
    _check_gpt_config(cfg)
    d, m = cfg.d_model, cfg.mlp_dim
    bias = 1 if cfg.use_bias else 0
    attention = d * 3 * d + bias * 3 * d + d * d + bias * d
    mlp = d * m + bias * m + m * d + bias * d
    layer_norms = 2 * (2 * d)
    per_block = attention + mlp + layer_norms
    embeddings = cfg.vocab_size * d + cfg.seq_len * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return cfg.n_layers * per_block + embeddings + 2 * d + head


def gpt_flops_param_count(cfg: GPTConfig) -> int:
    """Returns N of the FLOP formula (see the module docstring)."""
    lookups = cfg.seq_len * cfg.d_model
    if not cfg.tie_embeddings:
        lookups += cfg.vocab_size * cfg.d_model
    return gpt_param_count(cfg) - lookups


def gpt_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 6N + 12 * n_layers * d_model * seq_len.

    Args:
      cfg: The model config.
      seq_len: Trained sequence length; defaults to ``cfg.seq_len``.
    """
    _check_gpt_config(cfg)
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if not isinstance(seq_len, int) or not 1 <= seq_len <= cfg.seq_len:
        raise ValueError(f"seq_len={seq_len!r} must be an int in [1, {cfg.seq_len}]")
    return 6 * gpt_flops_param_count(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len
