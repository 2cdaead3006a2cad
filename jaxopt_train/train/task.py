"""From a `TrainConfig` to a model, its datasets and its FLOP count.

A `Task` bundles what the loop needs and nothing else: the wrapped model
(`ModelFns`), deterministic `train_batch(step)` / `eval_batch(i)` functions
(so a resumed run sees the same data order), what one example is worth in
throughput units (tokens or images) and in training FLOPs (for MFU).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

from jaxopt_train.precision import Policy
from jaxopt_train.train.config import TrainConfig, data_suffix, matmul_dot_general
from jaxopt_train.train.model import ModelFns, gpt_loss_fn, nnx_model_fns, vision_loss_fn


@dataclasses.dataclass
class Task:
    fns: ModelFns
    train_batch: Callable[[int], dict[str, np.ndarray]]
    eval_batch: Callable[[int], dict[str, np.ndarray]]
    unit: str                   # "tokens" or "images"
    units_per_example: int      # seq_len for GPT, 1 for images
    flops_per_example: float    # training FLOPs (forward + backward) of one example
    description: str
    # The data's size (tokens, or images) where it is read from files, None for synthetic
    # data: a resume on data of another size draws other batches (`resume.data_size_change`).
    data_size: int | None = None
    # A vision run's classifier width: --num-classes widened to the data's largest label + 1.
    # Recorded in the model shape (`TrainConfig.model_shape`): the flag alone does not fix it.
    classes: int | None = None


def build_task(cfg: TrainConfig, policy: Policy) -> Task:
    """The model and data of `cfg` (GPT presets on text/tokens, vision presets on images)."""
    if cfg.is_vision:
        return _vision_task(cfg, policy)
    return _gpt_task(cfg, policy)


def gpt_model_config(cfg: TrainConfig, policy: Policy, vocab_size: int | None = None):
    """The `GPTConfig` of a run: preset + overrides + the policy's dtypes + execution options."""
    from jaxopt_train.models import get_gpt_config  # noqa: PLC0415

    overrides: dict[str, Any] = dict(
        dtype=policy.compute_dtype, param_dtype=policy.param_dtype, attention=cfg.attention,
        remat=cfg.remat, scan_layers=cfg.scan_layers)
    if cfg.seq_len is not None:
        overrides["seq_len"] = cfg.seq_len
    if cfg.matmul != "xla":
        # Inside the trainer's shard_map each device multiplies its local shard,
        # so a Pallas/Triton call (which XLA cannot partition) is fine there.
        overrides["dot_general"] = matmul_dot_general(cfg.matmul)
    overrides.update(cfg.model_overrides)
    model_cfg = _prefer_cudnn_attention(get_gpt_config(cfg.preset, **overrides))
    if vocab_size is not None and vocab_size > model_cfg.vocab_size:
        # Whose vocabulary: "preset='gpt-tiny' has vocab_size=10" blamed the preset for an override.
        owner = ("--model vocab_size" if "vocab_size" in cfg.model_overrides
                 else f"preset={cfg.preset!r}")
        raise ValueError(f"the data has token ids up to {vocab_size - 1} but {owner} "
                         f"has vocab_size={model_cfg.vocab_size}; use a preset with a larger "
                         f"vocabulary or override it with --model vocab_size={vocab_size} "
                         f"(model_overrides={{'vocab_size': {vocab_size}}})")
    return model_cfg


def _prefer_cudnn_attention(model_cfg):
    """attention="auto" means cuDNN flash attention wherever it can run.

    Left to itself JAX's "auto" picks XLA's attention on GPU, which materialises
    the [T, T] scores; cuDNN's fused kernel is the fast path on NVIDIA Ampere
    (compute capability 8.0) and newer GPUs (bf16/f16 compute, head_dim % 8 == 0,
    and head_dim <= 128, or up to `CUDNN_MAX_HEAD_DIM` on Hopper (9.0) and newer).
    """
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxopt_train.models.gpt import cudnn_attention_unavailable  # noqa: PLC0415

    if (model_cfg.attention == "auto"
            and jnp.dtype(model_cfg.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and model_cfg.head_dim % 8 == 0 and cudnn_attention_unavailable() is None
            and model_cfg.head_dim <= _cudnn_max_head_dim()):
        return dataclasses.replace(model_cfg, attention="cudnn")
    return model_cfg


def _cudnn_max_head_dim() -> int:
    """The largest head_dim cuDNN attention takes on every GPU of this run."""
    import jax  # noqa: PLC0415

    from jaxopt_train.models.gpt import CUDNN_MAX_HEAD_DIM  # noqa: PLC0415
    from jaxopt_train.runtime._backend import compute_capability  # noqa: PLC0415

    # The oldest GPU decides; a device whose capability cannot be read counts as
    # pre-Hopper, where "auto" falling back to XLA is slower but a cuDNN head_dim past
    # 128 would fail to compile. This process's GPUs, as `cudnn_attention_unavailable`
    # reads them: the hosts of one job run one kind of GPU.
    capabilities = [compute_capability(device) for device in jax.local_devices()]
    return CUDNN_MAX_HEAD_DIM if min(capabilities) >= (9, 0) else 128


def _load_tokens(cfg: TrainConfig) -> tuple[np.ndarray, int, str]:
    """(tokens, smallest vocab that covers them, description)."""
    from jaxopt_train.data.text import load_text_corpus  # noqa: PLC0415
    from jaxopt_train.data.tokens import load_token_file, max_token_id  # noqa: PLC0415

    if cfg.data is None:
        tokens = load_text_corpus(None)
        return tokens, 256, f"embedded corpus (Python stdlib sources, {tokens.size:,} bytes)"
    if not os.path.exists(cfg.data):
        raise FileNotFoundError(f"data={cfg.data!r} does not exist; give a text file or folder, "
                                "a .bin token file, or a .npz of images")
    if data_suffix(cfg.data) == ".bin":
        tokens = load_token_file(cfg.data, cfg.token_dtype)
        # Scanned once here (about a second per GB): an id past the model's vocab
        # would only show later as NaN losses and a misleading "lower --lr" stop.
        return (tokens, max_token_id(tokens) + 1,
                f"token file {cfg.data} ({tokens.size:,} {cfg.token_dtype} tokens)")
    tokens = load_text_corpus(cfg.data)
    return tokens, 256, f"text {cfg.data} ({tokens.size:,} bytes)"


def _gpt_task(cfg: TrainConfig, policy: Policy) -> Task:
    from flax import nnx  # noqa: PLC0415

    from jaxopt_train.data.tokens import TokenDataset  # noqa: PLC0415
    from jaxopt_train.models import GPT, gpt_flops_per_token  # noqa: PLC0415

    if cfg.data is not None and data_suffix(cfg.data) == ".npz":
        raise ValueError(f"data={cfg.data!r} holds images but preset={cfg.preset!r} is a language "
                         "model; use --preset cnn-small/resnet18/resnet50 for images")
    tokens, data_vocab, description = _load_tokens(cfg)
    model_cfg = gpt_model_config(cfg, policy, data_vocab)
    train_ds = TokenDataset(tokens, model_cfg.seq_len, split="train", seed=cfg.seed)
    val_ds = TokenDataset(tokens, model_cfg.seq_len, split="val", seed=cfg.seed)
    model = GPT(model_cfg, rngs=nnx.Rngs(cfg.seed))
    # gpt_loss reads 16-bit logits in float32 itself: an f32 copy of the [batch, seq, vocab]
    # logits would cost memory and time for nothing.
    fns = nnx_model_fns(model, gpt_loss_fn, policy, cast_outputs=False)
    return Task(
        fns=fns,
        train_batch=lambda step: train_ds.batch(step, cfg.batch_size),
        eval_batch=lambda i: val_ds.batch(i, cfg.batch_size),
        unit="tokens", units_per_example=model_cfg.seq_len,
        flops_per_example=float(gpt_flops_per_token(model_cfg)) * model_cfg.seq_len,
        description=(f"{cfg.preset} (d_model={model_cfg.d_model}, layers={model_cfg.n_layers}, "
                     f"seq_len={model_cfg.seq_len}, matmul {cfg.matmul}) on {description}"),
        data_size=int(tokens.size))


def _vision_task(cfg: TrainConfig, policy: Policy) -> Task:
    from flax import nnx  # noqa: PLC0415

    from jaxopt_train.models import create_vision_model  # noqa: PLC0415

    if cfg.data is not None:
        from jaxopt_train.data.images import (  # noqa: PLC0415
            ImageDataset, check_labels, load_image_npz)

        if data_suffix(cfg.data) != ".npz":
            raise ValueError(f"data={cfg.data!r}: preset={cfg.preset!r} trains on images; give an "
                             ".npz with 'images' [N,H,W,C] and 'labels' [N]")
        arrays = load_image_npz(cfg.data)
        # The classifier widens to the largest label, so --num-classes is a lower bound;
        # what remains to refuse is a negative id (e.g. an ignore index of -100).
        num_classes = max(cfg.num_classes, int(np.max(arrays["labels"])) + 1)
        check_labels(arrays["labels"], num_classes, f"labels of {cfg.data!r}")  # negatives first
        if num_classes < 2:
            raise ValueError(f"every label of {cfg.data!r} is 0 and num_classes={cfg.num_classes}: "
                             "a classifier over one class has a loss of 0 whatever it predicts; "
                             "expected labels of two classes or more")
        train_ds = ImageDataset(arrays["images"], arrays["labels"], split="train", seed=cfg.seed)
        val_ds = ImageDataset(arrays["images"], arrays["labels"], split="val", seed=cfg.seed)
        _, height, width, channels = arrays["images"].shape  # not train_ds.images: a copy
        image_size = (height, width)
        train_batch = lambda step: train_ds.batch(step, cfg.batch_size)  # noqa: E731
        eval_batch = lambda i: val_ds.batch(i, cfg.batch_size)  # noqa: E731
        # Both counts: on a small set the held-out share is rounded to at least one example.
        description = (f"images {cfg.data} ({train_ds.num_examples:,} train / "
                       f"{val_ds.num_examples:,} val examples, {height}x{width}x{channels})")
        data_size = int(len(arrays["labels"]))
    else:
        from jaxopt_train.data.synthetic import synthetic_image_batch  # noqa: PLC0415

        num_classes, image_size, channels = cfg.num_classes, cfg.image_size, 3

        def train_batch(step):
            return synthetic_image_batch(cfg.batch_size, image_size=image_size,
                                         num_classes=num_classes, seed=cfg.seed * 1_000_003 + step)

        def eval_batch(i):
            return synthetic_image_batch(cfg.batch_size, image_size=image_size,
                                         num_classes=num_classes, seed=2**40 + cfg.seed * 1_000_003 + i)
        description = f"synthetic {image_size}x{image_size} images (random labels)"
        data_size = None
    model = create_vision_model(cfg.preset, num_classes=num_classes, dtype=policy.compute_dtype,
                                param_dtype=policy.param_dtype, rngs=nnx.Rngs(cfg.seed),
                                in_channels=channels,
                                axis_name="data")  # BatchNorm statistics over all devices
    fns = nnx_model_fns(model, vision_loss_fn, policy)
    return Task(fns=fns, train_batch=train_batch, eval_batch=eval_batch, unit="images",
                units_per_example=1,
                flops_per_example=_vision_flops(cfg.preset, image_size, channels, num_classes),
                description=f"{cfg.preset} on {description}", data_size=data_size,
                classes=num_classes)


def _vision_flops(preset: str, image_size: int | tuple[int, int], channels: int,
                  num_classes: int) -> float:
    from jaxopt_train.models.flops import resnet_flops_per_image  # noqa: PLC0415

    return float(resnet_flops_per_image(preset, image_size=image_size, num_classes=num_classes,
                                        in_channels=channels, training=True))
