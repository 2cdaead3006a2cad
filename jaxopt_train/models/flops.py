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

import operator

import numpy as np

from jaxopt_train.models.gpt import GPTConfig
from jaxopt_train.models.resnet import VISION_PRESETS, VISION_SPECS


def _check_gpt_config(cfg: GPTConfig) -> None:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig (e.g. get_gpt_config('gpt-124m')), "
                        f"got {type(cfg).__name__}")


def _check_int(name: str, value, *, maximum: int | None = None) -> int:
    """`value` as an int in [1, maximum]; numpy integers count, bools do not."""
    legal = f"an int in [1, {maximum}]" if maximum is not None else "a positive int"
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be {legal}, not a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be {legal}, got {type(value).__name__}") from None
    if value < 1 or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be {legal}")
    return value


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
    _check_gpt_config(cfg)
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
    seq_len = cfg.seq_len if seq_len is None else _check_int("seq_len", seq_len, maximum=cfg.seq_len)
    return 6 * gpt_flops_param_count(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len


def _check_vision_name(name: str) -> None:
    if not isinstance(name, str) or name not in VISION_SPECS:  # a list name: unhashable
        raise ValueError(f"name={name!r} is not a vision preset; legal values: {VISION_PRESETS}")


def _conv_out(size: int, kernel: int, stride: int) -> int:
    # Same symmetric padding as resnet._Layers.conv (and the 3x3/2 max-pool).
    pad = (kernel - 1) // 2
    return (size + 2 * pad - kernel) // stride + 1


def _conv_macs(hw: tuple[int, int], cin: int, cout: int, kernel: int,
               stride: int) -> tuple[int, tuple[int, int]]:
    out = (_conv_out(hw[0], kernel, stride), _conv_out(hw[1], kernel, stride))
    return out[0] * out[1] * kernel * kernel * cin * cout, out


def _check_image_size(image_size) -> tuple[int, int]:
    """`image_size` (a side, or a (height, width) pair) as (height, width)."""
    if not isinstance(image_size, (tuple, list)):
        side = _check_int("image_size", image_size)
        return side, side
    legal = "a positive int or a (height, width) pair of positive ints"
    if len(image_size) != 2:
        raise ValueError(f"{image_size=} must be {legal}; got {len(image_size)} values")
    try:
        return _check_int("height", image_size[0]), _check_int("width", image_size[1])
    except (TypeError, ValueError) as err:
        raise type(err)(f"{image_size=} must be {legal} ({err})") from None


def vision_forward_macs(name: str, image_size: int | tuple[int, int], num_classes: int = 1000,
                        in_channels: int = 3) -> int:
    """Multiply-accumulates of one forward pass of one image.

    Args:
      name: A vision preset.
      image_size: Side of a square image, or its (height, width).
      num_classes: Classifier outputs.
      in_channels: Channels of the image (the first convolution's input width).
    """
    _check_vision_name(name)
    hw = _check_image_size(image_size)
    num_classes = _check_int("num_classes", num_classes)
    in_channels = _check_int("in_channels", in_channels)
    spec = VISION_SPECS[name]
    total = 0
    if spec.kind == "cnn":
        chans = (in_channels, *spec.widths)
        for i in range(len(spec.widths)):
            macs, hw = _conv_macs(hw, chans[i], chans[i + 1], 3, 1 if i == 0 else 2)
            total += macs
        return total + spec.widths[-1] * num_classes
    macs, hw = _conv_macs(hw, in_channels, spec.widths[0], 7, 2)
    total += macs
    hw = (_conv_out(hw[0], 3, 2), _conv_out(hw[1], 3, 2))  # max-pool
    cin = spec.widths[0]
    for stage, (blocks, width) in enumerate(zip(spec.stage_sizes, spec.widths)):
        for index in range(blocks):
            stride = 2 if stage > 0 and index == 0 else 1
            cout = width * spec.expansion
            if spec.block == "bottleneck":
                shapes = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
            else:
                shapes = [(cin, width, 3, stride), (width, width, 3, 1)]
            block_in = hw
            for c_in, c_out, kernel, s in shapes:
                macs, hw = _conv_macs(hw, c_in, c_out, kernel, s)
                total += macs
            if stride != 1 or cin != cout:
                total += _conv_macs(block_in, cin, cout, 1, stride)[0]
            cin = cout
    return total + cin * num_classes


def resnet_flops_per_image(
    name: str, *, image_size: int | tuple[int, int] | None = None, num_classes: int = 1000,
    training: bool = True, in_channels: int = 3,
) -> int:
    """FLOPs per image: 2 x MACs forward, x3 when ``training`` (see the module doc).

    Args:
      name: A vision preset ("resnet18", "resnet50", "cnn-small").
      image_size: Side of a square input, or its (height, width); default 224
        for ResNets, 32 for cnn-small.
      num_classes: Classifier outputs.
      training: Count forward + backward (3x forward) instead of forward only.
      in_channels: Input channels (1 for grayscale, 3 for RGB); only the first
        convolution depends on it.
    """
    _check_vision_name(name)
    if not isinstance(training, (bool, np.bool_)):  # "no" or None counted 3x or 1x silently
        raise TypeError(f"training={training!r} must be True (forward + backward) or False")
    image_size = VISION_SPECS[name].default_image_size if image_size is None else image_size
    forward = 2 * vision_forward_macs(name, image_size, num_classes, in_channels)
    return 3 * forward if training else forward
