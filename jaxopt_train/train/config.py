"""`TrainConfig`: every knob of a training run, validated where it enters.

Validation happens once, in `__post_init__`, so that a bad value fails before
any device work starts, with a message naming the field, the value given and
what is allowed. Checks that need the device count (batch divisibility) live
in the trainer, which knows the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

GPT_PRESETS = ("gpt-tiny", "gpt-124m", "gpt-350m", "gpt-1b", "gpt-7b")
VISION_PRESETS = ("cnn-small", "resnet18", "resnet50")
PRESETS = GPT_PRESETS + VISION_PRESETS
PRECISIONS = ("fp32", "tf32", "bf16", "bf16-pure", "fp16")
GRAD_SYNCS = ("psum", "ring", "ring_bidir", "hierarchical", "peer")
GRAD_COMPRESSIONS = ("none", "bf16", "int8")
GRAD_DTYPES = ("param", "compute")
MATMULS = ("xla", "pallas", "triton")
# The matmul kernels take bf16/fp16 operands; an f32 compute dtype never reaches them.
_KERNEL_COMPUTE_DTYPES = ("bfloat16", "float16")
ATTENTIONS = ("auto", "xla", "cudnn")
REMATS = ("none", "dots_attention", "dots", "full")
TOKEN_DTYPES = ("uint16", "uint32")  # jaxopt_train.data.tokens.TOKEN_FILE_DTYPES

# Fields that fix the shapes of the parameters: a run directory created with
# one value cannot be resumed with another. (A vision run records its classifier's
# width instead of num_classes, a lower bound: `TrainConfig.model_shape`.)
MODEL_SHAPE_FIELDS = ("preset", "model_overrides", "num_classes", "image_size")
# The largest seed: the model's init key is `jax.random.key(seed)`, which takes an int64.
MAX_SEED = 2**63 - 1
# GPT overrides that choose what is recomputed, never a shape: a run may resume with others.
REMAT_OVERRIDES = ("remat", "remat_layers", "remat_rest")


# GPT fields that a TrainConfig field (or its precision policy) sets: an override of one won
# over the flag without a word (--model remat=dots with --remat full ran dots, and
# config.json said full). Field -> what sets it.
OWNED_OVERRIDES = {"remat": "remat (--remat)", "attention": "attention (--attention)",
                   "scan_layers": "scan_layers (--scan-layers)", "seq_len": "seq_len (--seq-len)",
                   "dtype": "precision (--precision)", "param_dtype": "precision (--precision)",
                   "dot_general": "matmul (--matmul)"}


def shape_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """`model_overrides` without the fields that leave every parameter's shape as it is."""
    return {k: v for k, v in overrides.items() if k not in REMAT_OVERRIDES}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    Attributes:
      preset: model preset, one of `PRESETS`.
      steps: total optimizer steps of the run (a resumed run continues to it).
      batch_size: global batch (sequences or images per optimizer step, all
        devices together); divisible by devices x microbatches.
      microbatches: micro-batches accumulated per device per optimizer step.
      precision: precision policy name (`PRECISIONS`) or a spec such as
        "p=f32,c=bf16,o=f32" (see `jaxopt_train.precision.Policy.from_string`).
      lr: peak learning rate of the warmup-cosine schedule.
      warmup: linear warmup steps.
      weight_decay: AdamW decoupled weight decay (matrices only).
      clip_norm: global gradient-norm clip; 0 disables clipping.
      data: text file/folder, `.bin` token file or `.npz` images; None means
        the embedded corpus (GPT) or synthetic images (vision).
      token_dtype: width of the ids in a `.bin` token file (`TOKEN_DTYPES`):
        "uint16" (nanoGPT's layout, vocab <= 65536) or "uint32".
      run_dir: directory for metrics.jsonl, config.json and checkpoints;
        None makes a fresh `runs/<preset>-<date>-<time>`.
      resume: continue from the latest checkpoint in `run_dir`.
      overwrite: delete an existing run's checkpoints and metrics and start over.
      log_every: steps between metric lines (also the host-sync interval).
      eval_every: steps between evaluations; 0 evaluates only at the end.
      eval_batches: validation batches per evaluation.
      checkpoint_every: steps between checkpoints; 0 saves only at the end.
      keep_checkpoints: how many recent checkpoints to keep.
      seed: seed of parameter init and of per-step RNG keys.
      grad_sync: cross-device gradient reduction (`GRAD_SYNCS`); "peer" is the
        one-kernel exchange of 2 Hopper GPUs in one process
        (`collectives.peer_all_reduce`).
      grad_compression: wire format of the gradient reduction.
      zero: ZeRO stage over the data axis (`ZERO_STAGES`): 0 replicated, 1
        optimizer state sharded per leaf (each gradient leaf reduce-scattered
        on its own, overlapping the backward), 3 parameters sharded per leaf
        too (FSDP-style: each leaf all-gathered at the step's start, in the
        compute dtype with grad_dtype "compute", overlapping the forward).
        Needs grad_sync "psum" or "ring" and no grad_compression.
      grad_dtype: "param" (gradients in the params' dtype) or "compute" (in the
        compute dtype, e.g. bf16 under --precision bf16, widened after the one
        cross-device reduction: half the gradient memory and reduction bytes;
        at zero 3 the parameter all-gathers move it too). Needs no
        grad_compression.
      opt_state_dtype: storage dtype of AdamW's moments, "f32" or "bf16" (half
        their memory and traffic; the update math stays f32).
      steps_per_dispatch: optimizer steps run by one compiled call (lax.scan
        over pre-staged batches): fewer host round trips for small models.
      matmul: dense-layer matmul of GPT presets (`MATMULS`): "xla" (lax.dot_general),
        "pallas" (`jaxopt_train.kernels`: Mosaic GPU on Hopper, Mosaic TPU on TPU,
        interpret mode on CPU - slow, for tests) or "triton" (jax-triton, CUDA).
        Needs a bf16/fp16 compute dtype; checked for availability here.
      attention: attention implementation for GPT presets (`ATTENTIONS`).
      remat: per-block rematerialisation policy (`REMATS`), or "auto": the least
        recompute whose compiled step fits each device's memory pool (GPT presets;
        resolved when the run is built, and saved as chosen in run_dir/config.json).
      scan_layers: scan over stacked GPT layers: compiles faster (7.6 s vs 19.4 s for
        gpt-1b on an H200) but ran 25% slower there (43% vs 54% MFU), so it is off by default.
      model_overrides: extra GPT config fields, e.g. {"d_model": 64}.
      seq_len: GPT sequence length; None keeps the preset's.
      num_classes: classes of the vision presets.
      image_size: side of the synthetic square images of the vision presets.
      peak_tflops: per-device peak TFLOP/s for MFU; None looks it up.
      max_nonfinite_steps: stop after this many consecutive non-finite steps.
      tensorboard: also write TensorBoard event files to run_dir/tb.
      prometheus_port: serve metrics for Prometheus on this port (0: any free
        port, printed at the start of the run).
      profile_steps: "START:STOP" step range traced with jax.profiler.
      progress: "auto" (a bar on a terminal), "bar" or "lines".
    """

    preset: str = "gpt-tiny"
    steps: int = 200
    batch_size: int = 16
    microbatches: int = 1
    precision: str = "fp32"
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    data: str | None = None
    token_dtype: str = "uint16"
    run_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    seed: int = 0
    grad_sync: str = "psum"
    grad_compression: str = "none"
    grad_dtype: str = "param"
    opt_state_dtype: str = "f32"
    steps_per_dispatch: int = 1
    zero: int = 0
    matmul: str = "xla"
    attention: str = "auto"
    remat: str = "none"
    scan_layers: bool = False
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    seq_len: int | None = None
    num_classes: int = 10
    image_size: int = 32
    peak_tflops: float | None = None
    max_nonfinite_steps: int = 25
    tensorboard: bool = False
    prometheus_port: int | None = None
    profile_steps: str | None = None
    progress: str = "auto"

    def __post_init__(self):
        _check_choice("preset", self.preset, PRESETS)
        # Truthiness is not enough: resume="no" resumed a run, tensorboard="false" wrote events.
        for name in ("resume", "overwrite", "scan_layers", "tensorboard"):
            _check_bool(name, getattr(self, name))
        # A pathlib.Path is welcome, stored as the str that config.json and the CLI hold: a
        # Path("train.bin") was refused its --token-dtype, and a Path run_dir was told it
        # "must be a non-empty path". Anything else is refused here: data=0 failed inside
        # os.path once the run was being built.
        for name in ("data", "run_dir"):
            object.__setattr__(self, name, _check_path(name, getattr(self, name)))
        for name in ("steps", "batch_size", "microbatches", "log_every", "eval_batches",
                     "keep_checkpoints", "steps_per_dispatch", "max_nonfinite_steps",
                     "num_classes", "image_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "eval_every", "checkpoint_every"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_seed(self.seed)
        # The type before check_zero, which names the stages: a numpy int went into
        # config.json as the string "1", which a --resume then refused.
        if isinstance(self.zero, bool) or not isinstance(self.zero, int):
            _check_int("zero", self.zero, minimum=0)  # raises its TypeError
        _check_float("lr", self.lr, positive=True)
        _check_float("weight_decay", self.weight_decay, positive=False)
        _check_float("clip_norm", self.clip_norm, positive=False)
        if self.peak_tflops is not None:
            _check_float("peak_tflops", self.peak_tflops, positive=True)
        if self.seq_len is not None:
            _check_int("seq_len", self.seq_len, minimum=1)
        if self.prometheus_port is not None:
            _check_int("prometheus_port", self.prometheus_port, minimum=0)
            if self.prometheus_port > 65535:
                raise ValueError(f"prometheus_port={self.prometheus_port} must be a TCP port in "
                                 "0..65535 (0 picks a free one)")
        _check_precision(self.precision)
        _check_choice("grad_sync", self.grad_sync, GRAD_SYNCS)
        _check_choice("grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
        if self.grad_sync == "peer" and self.grad_compression == "int8":
            raise ValueError("grad_sync='peer' sends bf16 or uncompressed gradients; got grad_compression='int8' "
                             "(use grad_sync 'ring' for int8)")
        from jaxopt_train.train.zero_step import check_zero  # noqa: PLC0415

        check_zero(self.zero, self.grad_sync, self.grad_compression)
        from jaxopt_train.train.optim import STATE_DTYPES  # noqa: PLC0415
        from jaxopt_train.train.trainer import check_grad_dtype  # noqa: PLC0415

        check_grad_dtype(self.grad_dtype, self.grad_compression)
        _check_choice("opt_state_dtype", self.opt_state_dtype, STATE_DTYPES)
        _check_choice("matmul", self.matmul, MATMULS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("remat", self.remat, REMATS + ("auto",))
        _check_choice("progress", self.progress, ("auto", "bar", "lines"))
        _check_choice("token_dtype", self.token_dtype, TOKEN_DTYPES)
        token_file = isinstance(self.data, str) and data_suffix(self.data) == ".bin"
        if self.token_dtype != "uint16" and not token_file:
            raise ValueError(f"token_dtype={self.token_dtype!r} applies to a .bin token file, but "
                             f"data={self.data!r}; drop it or give the .bin file")
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by microbatches={self.microbatches}")
        if self.steps_per_dispatch > 1:
            for name in ("steps", "log_every", "eval_every", "checkpoint_every"):
                if getattr(self, name) % self.steps_per_dispatch:
                    raise ValueError(
                        f"{name}={getattr(self, name)} must be a multiple of "
                        f"steps_per_dispatch={self.steps_per_dispatch} (steps run in groups of it)")
        if not isinstance(self.model_overrides, dict):
            raise TypeError(f"model_overrides={self.model_overrides!r} must be a dict of GPT config fields")
        not_names = [k for k in self.model_overrides if not isinstance(k, str)]
        if not_names:  # else "keywords must be strings" from deep in the model's build
            raise TypeError(f"model_overrides={self.model_overrides!r} has keys {not_names} that "
                            "are not field names; expected str keys, e.g. {'d_model': 64}")
        owned = [k for k in self.model_overrides if k in OWNED_OVERRIDES]
        if owned:
            raise ValueError(
                f"model_overrides={self.model_overrides} set {owned}, which the run sets "
                f"itself; use {', '.join(OWNED_OVERRIDES[k] for k in owned)} instead")
        if self.model_overrides and self.preset not in GPT_PRESETS:
            raise ValueError(f"model_overrides={self.model_overrides} only apply to GPT presets "
                             f"{GPT_PRESETS}, not preset={self.preset!r}")
        # Taken silently before, by a vision run that has no sequence and no layers to scan.
        for name, unset in (("seq_len", None), ("scan_layers", False), ("attention", "auto")):
            if self.is_vision and getattr(self, name) != unset:
                raise ValueError(f"{name}={getattr(self, name)!r} only applies to GPT presets "
                                 f"{GPT_PRESETS}, not preset={self.preset!r}; drop it")
        # And the other way round: a GPT run has no classes and no image side to set.
        for name in ("num_classes", "image_size"):
            if not self.is_vision and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} only applies to vision presets "
                                 f"{VISION_PRESETS}, not preset={self.preset!r}; drop it")
        if self.is_vision and self.data is None and self.num_classes < 2:
            # The synthetic labels are then all 0 and log_softmax over one logit is 0: a run
            # that logged loss 0.0000 at every step and learned nothing. (With data it is a lower
            # bound the labels widen; the task refuses labels of one class.)
            raise ValueError(f"num_classes={self.num_classes} with synthetic images: a classifier "
                             "over one class has a loss of 0 whatever it predicts; expected >= 2")
        if self.is_vision and self.data is not None and self.image_size != _DEFAULTS["image_size"]:
            # It sizes synthetic images only: with --data the run trained on the file's images,
            # while the flag went into the checkpoint's model shape and refused a resume.
            raise ValueError(f"image_size={self.image_size} sizes the synthetic images; with "
                             f"data={self.data!r} the images are the file's own size: drop it")
        if self.resume and self.overwrite:
            raise ValueError("resume=True and overwrite=True contradict each other: pick one")
        if self.run_dir == "":
            raise ValueError(f"run_dir={self.run_dir!r} must be a non-empty path or None")
        if self.resume and self.run_dir is None:
            raise ValueError("resume=True needs run_dir: the directory of the run to continue")
        if self.profile_steps is not None:
            start, _ = parse_profile_steps(self.profile_steps)
            if start >= self.steps:
                raise ValueError(f"profile_steps={self.profile_steps!r} starts at step {start}, but "
                                 f"training runs steps 0..{self.steps - 1} (steps={self.steps}); "
                                 f"pick a range that starts below {self.steps}")
        if self.matmul != "xla":
            self._check_matmul()
        if self.attention == "cudnn":
            self._check_compute_dtype_for("attention", "cuDNN's fused attention", "'auto' or 'xla'")

    def _check_matmul(self) -> None:
        if self.is_vision:
            raise ValueError(f"matmul={self.matmul!r} applies to GPT presets {GPT_PRESETS}, not "
                             f"preset={self.preset!r}; use matmul='xla'")
        self._check_compute_dtype_for("matmul", "the kernels' operand types", "'xla'")
        matmul_dot_general(self.matmul)  # fails now, not at the first step, if unavailable

    def _check_compute_dtype_for(self, field: str, why: str, fallback: str) -> None:
        """A kernel choice (`field`, not its default) that needs bf16 or fp16 operands;
        `fallback` is the value the message offers that takes any precision."""
        from jaxopt_train.precision import get_policy  # noqa: PLC0415

        compute = jnp_dtype_name(get_policy(self.precision).compute_dtype)
        if compute not in _KERNEL_COMPUTE_DTYPES:
            # attention='cudnn' under fp32 reached the model's own check, which named its
            # dtype= argument, not the --precision that sets it.
            raise ValueError(
                f"{field}={getattr(self, field)!r} needs a bf16 or fp16 compute dtype ({why}) "
                f"but precision={self.precision!r} computes in {compute}; use --precision bf16 "
                f"(or fp16), or {field}={fallback}")

    @property
    def is_vision(self) -> bool:
        return self.preset in VISION_PRESETS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def _param_dtype_name(self) -> str:
        return _param_dtype_name_of(self.precision)

    def model_shape(self, classes: int | None = None) -> dict[str, Any]:
        """The fields that determine parameter shapes (compared on resume).

        Args:
          classes: a vision run's classifier width (`Task.classes`): num_classes widened
            to the data's largest label + 1. Recorded as "classes" in place of num_classes,
            which does not fix the width. None: num_classes (synthetic data).
        """
        shape = {name: getattr(self, name) for name in MODEL_SHAPE_FIELDS}
        # The length itself, not "the preset's" (None): a resume that spells out the preset's
        # own --seq-len was refused as a change of shape.
        shape["seq_len"] = self.seq_len if self.is_vision else resolved_seq_len(self.preset,
                                                                               self.seq_len)
        # Not `zero`: the checkpoints of every stage hold whole (per-leaf) arrays, sharded or
        # not, and restore into any stage's layout; where the state's tree does differ (zero=0
        # chains the clip into the optimizer), the checkpoint's own tree check refuses it.
        if self.opt_state_dtype != "f32":  # so do its dtypes
            shape["opt_state_dtype"] = self.opt_state_dtype
        # A resume must not narrow (or widen) the saved weights: --precision bf16-pure on an
        # fp32 run loaded its checkpoint into bf16 params without a word.
        shape["param_dtype"] = self._param_dtype_name()
        shape["model_overrides"] = shape_overrides(self.model_overrides)
        if self.is_vision:
            shape.pop("model_overrides")
            shape.pop("seq_len")
            flag = shape.pop("num_classes")
            shape["classes"] = flag if classes is None else classes
        else:
            shape.pop("num_classes")
            shape.pop("image_size")
        return shape


_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainConfig)}


def data_suffix(path: str) -> str:
    """The extension that says how `--data` is read (".bin" token ids, ".npz" images,
    anything else text), in lower case: a TRAIN.BIN was read as text, its ids as bytes."""
    return os.path.splitext(path)[1].lower()


def resolved_seq_len(preset: str, seq_len: int | None) -> int:
    """`seq_len`, or the GPT preset's own when it is None."""
    if seq_len is not None:
        return seq_len
    from jaxopt_train.models.gpt_config import get_gpt_config  # noqa: PLC0415

    return get_gpt_config(preset).seq_len


def _param_dtype_name_of(precision: str) -> str:
    from jaxopt_train.precision import get_policy  # noqa: PLC0415

    return jnp_dtype_name(get_policy(precision).param_dtype)


def jnp_dtype_name(dtype) -> str:
    import numpy as np  # noqa: PLC0415

    return np.dtype(dtype).name


def matmul_dot_general(choice: str):
    """The `dot_general` of `TrainConfig.matmul`; ValueError naming why if unusable here.

    "xla" is `lax.dot_general`; "pallas"/"triton" come from
    `jaxopt_train.kernels.dot_general_for`, whose backend is resolved (and so
    checked against the platform: Hopper for Mosaic GPU, an Ampere or newer GPU and
    jax_triton for Triton)
    right away rather than at the first traced matmul.
    """
    _check_choice("matmul", choice, MATMULS)
    from jaxopt_train.kernels import dot_general_for  # noqa: PLC0415
    from jaxopt_train.kernels.matmul import resolve_backend  # noqa: PLC0415

    fn = dot_general_for(choice)
    backend = getattr(fn, "backend", None)
    if backend is not None:
        try:
            resolve_backend(backend)
        except RuntimeError as err:
            raise ValueError(f"matmul={choice!r} is unavailable here: {err}; use matmul='xla'"
                             ) from None
    return fn


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """Parses "START:STOP" (steps START..STOP-1) or "STEP" into (start, stop)."""
    from jaxopt_train.runtime.profiling import parse_step_range  # noqa: PLC0415

    try:
        return parse_step_range(spec)
    except ValueError as err:
        raise ValueError(f"profile_steps={spec!r}: {err}") from None


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(allowed)}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        # A numpy int is an integer, but not one config.json can hold: say what to pass.
        kind = f" (a {type(value).__module__}.{type(value).__name__}: pass int({name}))" \
            if hasattr(value, "dtype") else ""
        raise TypeError(f"{name}={value!r} must be a Python int >= {minimum}{kind}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False (a Python bool)")


def _check_path(name: str, value: Any) -> str | None:
    """`value` as a str path: None stays None, an os.PathLike is converted; TypeError else."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(f"{name}={value!r} must be a path (a str or pathlib.Path) or None")
    return path


def _check_seed(seed: Any) -> None:
    _check_int("seed", seed, minimum=0)
    if seed > MAX_SEED:  # jax.random.key raised OverflowError from inside the model's init
        raise ValueError(f"seed={seed} must be an integer in [0, 2**63 - 1 = {MAX_SEED}] "
                         "(JAX's PRNG keys take an int64)")


def _check_float(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number")
    bad = not math.isfinite(value) or value < 0 or (positive and value == 0)
    if bad:
        kind = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name}={value} must be {kind}")


def _check_precision(value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"precision={value!r} must be a string: one of {list(PRECISIONS)} "
                        f"or a spec like 'p=f32,c=bf16,o=f32'")
    if value in PRECISIONS:
        return
    hint = f"expected one of {list(PRECISIONS)} or a spec like 'p=f32,c=bf16,o=f32'"
    if "=" not in value:
        raise ValueError(f"precision={value!r} is not supported; {hint}")
    from jaxopt_train.precision import Policy, check_trainable  # noqa: PLC0415

    # Parsed here, as the run will: a prefix test let 'p=f32,c=xx' through to fail only once
    # the run was being built, and refused the same spec written 'c=bf16,p=f32'.
    try:
        check_trainable(Policy.from_string(value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"precision={value!r} is not supported ({err}); {hint}") from None
