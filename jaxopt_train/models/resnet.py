"""ResNet-18/50 (torchvision v1.5 layout) and a small CNN, in Flax NNX.

* Images are NHWC floats with ``in_channels`` channels (3 unless built with
  another count, e.g. 1 for grayscale; height and width are free);
  ``__call__(images, train)`` returns logits
  [B, num_classes] in the compute ``dtype`` (`classification_loss` upcasts).
* BatchNorm normalises with the batch statistics when ``train`` and with the
  running averages otherwise. Under ``jax.shard_map`` pass ``axis_name="data"``
  so each device normalises with the statistics of the *global* batch (one
  ``pmean`` of mean and mean-square per BatchNorm) - without it every device
  uses its own micro-batch and data-parallel training differs from one big
  batch. Under plain ``jax.jit`` with a sharded batch leave ``axis_name=None``:
  XLA's SPMD partitioner inserts the reduction itself.
* Convolutions have no bias (BatchNorm follows), the last BatchNorm of every
  residual branch starts at zero scale (each block starts as the identity,
  Goyal et al. 2017), the stride of a bottleneck sits on its 3x3 conv (v1.5).
* The layer shapes live in `VISION_SPECS` so `flops.resnet_flops_per_image`
  counts the same network that is built here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopt_train.models.gpt import canonical_dtype
from jaxopt_train.models.gpt_config import _positive_int
from jaxopt_train.models.losses import gpt_loss


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """Layer shapes of a preset.

    Attributes:
      kind: "resnet" or "cnn".
      block: "basic" (two 3x3) or "bottleneck" (1x1, 3x3, 1x1 x4) for ResNets.
      stage_sizes: Residual blocks per stage (ResNets).
      widths: Stage widths (ResNets) or conv widths (cnn, each conv after the
        first has stride 2).
      default_image_size: Side used by the FLOP count when none is given.
    """

    kind: str
    widths: tuple[int, ...]
    block: str = ""
    stage_sizes: tuple[int, ...] = ()
    default_image_size: int = 224

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


VISION_SPECS = {
    "resnet18": VisionSpec("resnet", (64, 128, 256, 512), "basic", (2, 2, 2, 2)),
    "resnet50": VisionSpec("resnet", (64, 128, 256, 512), "bottleneck", (3, 4, 6, 3)),
    "cnn-small": VisionSpec("cnn", (32, 64, 128), default_image_size=32),
}
VISION_PRESETS = tuple(VISION_SPECS)


@dataclasses.dataclass(frozen=True)
class _Layers:
    """Shared constructor arguments of every conv / norm / dense layer."""

    dtype: Any
    param_dtype: Any
    axis_name: str | None
    rngs: nnx.Rngs

    def conv(self, cin, cout, kernel, stride=1):
        pad = (kernel - 1) // 2
        return nnx.Conv(
            cin, cout, (kernel, kernel), (stride, stride), padding=((pad, pad), (pad, pad)),
            use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=nnx.initializers.variance_scaling(2.0, "fan_out", "normal"),
            rngs=self.rngs,
        )

    def norm(self, features, zero_scale=False):
        return nnx.BatchNorm(
            features, momentum=0.9, epsilon=1e-5, dtype=self.dtype, param_dtype=self.param_dtype,
            axis_name=self.axis_name,
            scale_init=nnx.initializers.zeros if zero_scale else nnx.initializers.ones,
            rngs=self.rngs,
        )

    def dense(self, cin, cout):
        return nnx.Linear(cin, cout, dtype=self.dtype, param_dtype=self.param_dtype, rngs=self.rngs)


def _normalise(norm: nnx.BatchNorm, x: jax.Array, train: bool) -> jax.Array:
    # Flax computes the statistics in float32 by promoting bf16 against a
    # float32 dtype, which strict dtype promotion rejects; the output stays in
    # the layer's compute dtype either way.
    with jax.numpy_dtype_promotion("standard"):
        return norm(x, use_running_average=not train)


class ResidualBlock(nnx.Module):
    """Basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1) block with a projection shortcut."""

    def __init__(self, layers: _Layers, cin: int, width: int, stride: int, bottleneck: bool):
        if bottleneck:
            cout = 4 * width
            shapes = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
        else:
            cout = width
            shapes = [(cin, width, 3, stride), (width, width, 3, 1)]
        self.convs = nnx.List([layers.conv(i, o, k, s) for i, o, k, s in shapes])
        self.norms = nnx.List(
            [layers.norm(o, zero_scale=n == len(shapes) - 1) for n, (_, o, _, _) in enumerate(shapes)]
        )
        self.has_shortcut = stride != 1 or cin != cout
        if self.has_shortcut:
            self.shortcut = layers.conv(cin, cout, 1, stride)
            self.shortcut_norm = layers.norm(cout)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        residual = x
        if self.has_shortcut:
            residual = _normalise(self.shortcut_norm, self.shortcut(x), train)
        for n, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = _normalise(norm, conv(x), train)
            if n < len(self.convs) - 1:
                x = jax.nn.relu(x)
        return jax.nn.relu(x + residual)


def _max_pool_3x3_s2(x: jax.Array) -> jax.Array:
    # The init value must be the Python scalar -inf: JAX recognises (lax.max, -inf)
    # as a max-pool it can differentiate; a traced array init is a generic
    # reduce_window, which has no reverse-mode rule.
    padding = ((0, 0), (1, 1), (1, 1), (0, 0))
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), padding)


class ResNet(nnx.Module):
    """ResNet for NHWC images (7x7/2 stem, 3x3/2 max-pool, 4 stages, global average pool)."""

    def __init__(self, spec: VisionSpec, *, num_classes: int, layers: _Layers, in_channels: int = 3):
        self.dtype = layers.dtype
        self.in_channels = in_channels
        self.stem = layers.conv(in_channels, spec.widths[0], 7, 2)
        self.stem_norm = layers.norm(spec.widths[0])
        blocks, cin = [], spec.widths[0]
        for stage, (size, width) in enumerate(zip(spec.stage_sizes, spec.widths)):
            for index in range(size):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(ResidualBlock(layers, cin, width, stride, spec.block == "bottleneck"))
                cin = width * spec.expansion
        self.blocks = nnx.List(blocks)
        self.head = layers.dense(cin, num_classes)

    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        images = _check_images(images, self.in_channels)
        train = _check_train(train)
        x = jax.nn.relu(_normalise(self.stem_norm, self.stem(images), train))
        x = _max_pool_3x3_s2(x)
        for block in self.blocks:
            x = block(x, train)
        return self.head(jnp.mean(x, axis=(1, 2)))


class SmallCNN(nnx.Module):
    """conv3x3 -> [conv3x3/2] * (len(widths) - 1), each with BatchNorm + ReLU, then mean-pool + dense."""

    def __init__(self, spec: VisionSpec, *, num_classes: int, layers: _Layers, in_channels: int = 3):
        chans = (in_channels, *spec.widths)
        self.convs = nnx.List(
            [layers.conv(chans[i], chans[i + 1], 3, 1 if i == 0 else 2) for i in range(len(spec.widths))]
        )
        self.norms = nnx.List([layers.norm(w) for w in spec.widths])
        self.head = layers.dense(spec.widths[-1], num_classes)
        self.in_channels = in_channels

    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        x = _check_images(images, self.in_channels)
        train = _check_train(train)
        for conv, norm in zip(self.convs, self.norms):
            x = jax.nn.relu(_normalise(norm, conv(x), train))
        return self.head(jnp.mean(x, axis=(1, 2)))


def _check_train(train) -> bool:
    """`train` as a Python bool, or TypeError: BatchNorm branches on it in Python, where any
    truthy value (the string "False" included) silently trained on batch statistics and
    overwrote the running averages."""
    if isinstance(train, (bool, np.bool_)):
        return bool(train)
    hint = ""
    if isinstance(train, jax.Array):  # a tracer is one too (jax.core.Tracer is not public API)
        hint = ("; an array (traced under jit?) cannot choose the branch: pass a Python bool, "
                "as a static argument under jit (e.g. nnx.jit(..., static_argnames='train'))")
    raise TypeError(f"train={train!r} must be True or False{hint}")


def _check_images(images, channels: int) -> jax.Array:
    """`images` as an array, or ValueError unless they are float NHWC with `channels` channels."""
    if not hasattr(images, "ndim"):  # a nested list: say what it holds, not "no .ndim" (as GPT)
        images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[-1] != channels or not jnp.issubdtype(images.dtype, jnp.floating):
        # Name the fix when only the channel count is off (say grayscale into an RGB model),
        # or when the channels come first (PyTorch's NCHW), where rebuilding is the wrong fix.
        hint = ""
        if images.ndim == 4 and images.shape[-1] != channels:
            hint = ("; build the model with create_vision_model(..., in_channels=C) for C-channel "
                    "images")
            if images.shape[1] == channels:
                hint = ("; these look like NCHW (channels first): transpose them to NHWC with "
                        "jnp.transpose(images, (0, 2, 3, 1))")
        raise ValueError(
            f"images must be float NHWC with {channels} channels, got shape={images.shape} "
            f"dtype={images.dtype}{hint}"
        )
    return images


def create_vision_model(
    name: str,
    *,
    num_classes: int,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
    axis_name: str | None = None,
    in_channels: int = 3,
) -> ResNet | SmallCNN:
    """Builds the vision preset ``name``.

    Args:
      name: One of `VISION_PRESETS`: "resnet18", "resnet50", "cnn-small".
      num_classes: Classifier outputs.
      dtype: Compute dtype ("bf16" style aliases accepted).
      param_dtype: Parameter storage dtype.
      rngs: Parameter init randomness.
      axis_name: Mesh axis over which BatchNorm averages its statistics when
        the model runs inside ``jax.shard_map`` (see the module docstring).
      in_channels: Channels of the input images (1 for grayscale, 3 for RGB);
        sets the first convolution's input width.
    """
    if not isinstance(name, str) or name not in VISION_SPECS:  # a list name: unhashable
        raise ValueError(f"name={name!r} is not a vision preset; legal values: {VISION_PRESETS}")
    # Numpy integers count (a class count from labels.max() + 1, a channel count from
    # images.shape), as in GPTConfig and the FLOP count; bools and floats do not.
    num_classes = _positive_int("num_classes", num_classes)
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
    try:
        in_channels = _positive_int("in_channels", in_channels)
    except ValueError:
        raise ValueError(f"{in_channels=} must be a positive int (1 for grayscale, 3 for RGB)") from None
    layers = _Layers(
        canonical_dtype(dtype, "dtype"), canonical_dtype(param_dtype, "param_dtype"), axis_name, rngs
    )
    spec = VISION_SPECS[name]
    model_class = ResNet if spec.kind == "resnet" else SmallCNN
    return model_class(spec, num_classes=num_classes, layers=layers, in_channels=in_channels)


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of [B, C] logits against int labels [B], in float32."""
    return gpt_loss(logits, labels)
