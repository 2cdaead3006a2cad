"""How the trainer sees a model: trainable params, other state, and one loss function.

Every model - our GPT and ResNet presets, a user's `nnx.Module`, a user's
`linen.Module` - is reduced to a `ModelFns`:

    loss(params, model_state, batch, train) -> (f32 scalar loss, new_model_state)

`params` are the trainable weights in the policy's param dtype (the f32
master weights for mixed precision); `model_state` is everything else the
forward pass updates (BatchNorm statistics), carried in the train state.
The forward pass runs under the `Policy`: params and floating inputs cast to
the compute dtype, its matmul precision applied.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxopt_train.precision import Policy


class ModelFns(NamedTuple):
    """A model as the trainer uses it (see the module docstring)."""

    params: Any
    model_state: Any
    loss: Callable[[Any, Any, Any, bool], tuple[jax.Array, Any]]
    merge: Callable[[Any, Any], Any]  # (params, model_state) -> the user's model object
    # weight(batch) -> scalar: what the loss is a mean over (tokens that count), so micro-
    # batches and devices count in proportion to it (accumulation.accumulate_gradients'
    # weight_fn); None: every example counts alike.
    weight: Callable[[Any], Any] | None = None


def _cast_like(tree, reference):
    def one(x, r):
        floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(r.dtype) if floating else x
    return jax.tree.map(one, tree, reference)


LOSS_SIGNATURE = ("loss_fn(model, batch) -> scalar loss, or loss_fn(model, batch, train) "
                  "with a parameter named `train`")


def check_loss_fn(loss_fn: Callable) -> None:
    """Raises TypeError unless `loss_fn` is callable as `loss_fn(model, batch[, train=...])`.

    The signature is checked with `inspect.signature` (callables without one
    are accepted here and tried at the first step), so TypeErrors raised
    inside the loss itself are never mistaken for a wrong signature.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable; expected {LOSS_SIGNATURE}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    train = {"train": True} if "train" in signature.parameters else {}
    try:
        signature.bind(None, None, **train)
    except TypeError as err:
        call = "loss_fn(model, batch, train=...)" if train else "loss_fn(model, batch)"
        raise TypeError(f"loss_fn{signature} cannot be called as {call} ({err}); expected "
                        f"{LOSS_SIGNATURE}") from None


def _wants_train_flag(loss_fn: Callable) -> bool:
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return "train" in parameters


def _call_loss(loss_fn: Callable, model, batch, train: bool) -> jax.Array:
    out = loss_fn(model, batch, train=train) if _wants_train_flag(loss_fn) else loss_fn(model, batch)
    if isinstance(out, (tuple, list)):
        raise ValueError(f"loss_fn must return the scalar loss alone; it returned a "
                         f"{type(out).__name__} of {len(out)} items (a (loss, aux) pair?): return "
                         "only the loss (aux outputs are not supported)")
    try:
        loss = jnp.asarray(out)
    except TypeError as err:
        raise ValueError(f"loss_fn must return a floating scalar; got a {type(out).__name__}"
                         ) from err
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a floating scalar; got shape={loss.shape} "
                         f"dtype={loss.dtype}")
    return loss.astype(jnp.float32)


def _warn_16_bit_embeds(what: str, paths: list[str], drop_in: str) -> None:
    if paths:
        # Trainer(...) -> Trainer.__init__ -> *_model_fns -> here: the warning names the
        # user's line.
        warnings.warn(
            f"{what} at {', '.join(paths)}: its table's gradient is a scatter-add in 16 "
            "bits, which drops a frequent id's contributions (and on GPU slows as training "
            f"goes on); {drop_in} is a drop-in that sums it in float32", UserWarning,
            stacklevel=4)


_POLICY_CALLS: dict[tuple, type] = {}


def _policy_call_class(cls: type, policy: Policy, cast_outputs: bool) -> type:
    """A subclass of the module class `cls` whose `__call__` runs under `policy`, as
    `linen_apply` does for Linen: floating arguments in the compute dtype and, with
    `cast_outputs`, results in the output dtype. The loss then runs in the output dtype
    (f32 under fp16): in float16 the scaled loss's cotangent at the outputs overflows from
    a loss scale of 2**16 on, and every step would be skipped before the scale could grow."""
    key = (cls, policy, cast_outputs)
    if key not in _POLICY_CALLS:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *policy.cast_to_compute(args),
                               **policy.cast_to_compute(kwargs))
            return policy.cast_to_output(out) if cast_outputs else out
        _POLICY_CALLS[key] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _POLICY_CALLS[key]


@contextlib.contextmanager
def _called_under(module, policy: Policy, cast_outputs: bool):
    """`module(...)` runs under `policy` inside the block. The instance's class is swapped
    for the block only: the loss sees the module itself (isinstance, `nnx.state(model)` and
    submodules keep working), and the module is merged afresh for every trace, so nothing
    outside the loss sees the swap."""
    cls = type(module)
    module.__class__ = _policy_call_class(cls, policy, cast_outputs)
    try:
        yield
    finally:
        module.__class__ = cls


def nnx_model_fns(model, loss_fn: Callable, policy: Policy, *,
                  cast_outputs: bool = True) -> ModelFns:
    """Wraps an `nnx.Module` and `loss_fn(model, batch[, train=...]) -> scalar`.

    `model(...)` casts its floating arguments to the compute dtype and returns the output
    dtype (as `linen_apply` does), and the loss gets the batch's floating entries in that
    same output dtype: targets meet outputs of their own dtype (f32 under "bf16" and
    "fp16", so they keep their precision), and the loss runs in the output dtype. Other
    methods the loss may call (`model.encode(x)`) are not wrapped: cast their inputs with
    `policy.cast_to_compute`. `cast_outputs=False` leaves the outputs, and the batch, in
    the compute dtype, for a loss that widens them itself (the GPT presets' cross-entropy
    reads 16-bit logits in float32 without an f32 copy of the [batch, seq, vocab] logits).

    `model.train()` / `model.eval()` are called before the loss, so Dropout and
    BatchNorm switch modes; a `loss_fn` with a `train` keyword also gets it.
    RNG streams the module holds (`nnx.Rngs`, e.g. in `nnx.Dropout`) are model
    state: they advance every step and are checkpointed; the train step salts
    them per device and per micro-batch (`train.step.local_gradients`), so each
    draws its own masks. Variables the loss sows
    (`nnx.Intermediate`) are dropped after each call.
    """
    from flax import nnx  # noqa: PLC0415

    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
    check_loss_fn(loss_fn)
    from jaxopt_train.models.embedding import low_precision_embeds  # noqa: PLC0415

    _warn_16_bit_embeds("nnx.Embed with a 16-bit dtype", low_precision_embeds(model),
                        "jaxopt_train.models.Embed")
    # RNG streams go with the rest of the model state: captured outside the step's
    # trace, Dropout's draw (which advances the stream's count) was refused in it.
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    params = policy.cast_to_param(params)

    def merge(params, model_state):
        return nnx.merge(graphdef, params, model_state)

    def loss(params, model_state, batch, train):
        # tree.map rebuilds the Variables inside the current trace, so BatchNorm
        # may update its statistics and Dropout advance its RNG count here (NNX
        # refuses mutating outer-trace ones).
        fresh_state = jax.tree.map(lambda x: x, model_state)
        module = nnx.merge(graphdef, policy.cast_to_compute(params), fresh_state)
        module.train() if train else module.eval()
        with policy.matmul_scope(), _called_under(module, policy, cast_outputs):
            seen = policy.cast_to_output(batch) if cast_outputs else policy.cast_to_compute(batch)
            value = _call_loss(loss_fn, module, seen, train)
        # Sown values (nnx.Intermediate) are outputs of this call, not state to carry.
        _, _, _, new_state = nnx.split(module, nnx.Param, nnx.Intermediate, ...)
        return value, _cast_like(new_state, model_state)

    return ModelFns(params, model_state, loss, merge)


def linen_model_fns(module, loss_fn: Callable, policy: Policy, init_args: tuple,
                    rng: jax.Array) -> ModelFns:
    """Wraps a `linen.Module` and `loss_fn(apply, batch[, train=...]) -> scalar`.

    `apply(*args, **kwargs)` runs `module.apply(variables, *args, **kwargs)`
    under the policy with the current variables; collections other than
    "params" (e.g. "batch_stats") are made mutable while training and carried
    as model state. `init_args` are example inputs for `module.init`.
    """
    import flax.linen as nn  # noqa: PLC0415

    from jaxopt_train.precision import linen_apply  # noqa: PLC0415

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a linen.Module, got {type(module).__name__}")
    if not isinstance(init_args, tuple):
        raise TypeError(f"init_args={type(init_args).__name__} must be a tuple of example inputs "
                        "for module.init")
    check_loss_fn(loss_fn)
    from jaxopt_train.models.embedding import (  # noqa: PLC0415
        linen_embeds_called,
        low_precision_linen_embeds,
    )

    with linen_embeds_called() as seen:
        variables = dict(module.init(rng, *init_args))
    # linen_apply hands the module its params in the compute dtype.
    _warn_16_bit_embeds(f"linen.Embed gathering in 16 bits under the {policy.compute_dtype.name} "
                        "compute dtype", low_precision_linen_embeds(seen, policy.compute_dtype),
                        "jaxopt_train.models.LinenEmbed")
    params = policy.cast_to_param(variables.pop("params"))
    model_state = variables

    def merge(params, model_state):
        return {"params": params, **model_state}

    def loss(params, model_state, batch, train):
        updates: dict[str, Any] = {}
        variables = {"params": params, **model_state}

        def apply(*args, **kwargs):
            if train and model_state:
                out, new = linen_apply(policy, module, variables, *args,
                                       mutable=list(model_state), **kwargs)
                updates.update(new)
                return out
            return linen_apply(policy, module, variables, *args, **kwargs)

        value = _call_loss(loss_fn, apply, batch, train)
        new_state = {**model_state, **updates}
        return value, _cast_like(new_state, model_state)

    return ModelFns(params, model_state, loss, merge)


def gpt_loss_fn(model, batch) -> jax.Array:
    """Next-token cross-entropy of a GPT on {"inputs", "targets"} batches."""
    from jaxopt_train.models import gpt_loss  # noqa: PLC0415

    return gpt_loss(model(batch["inputs"]), batch["targets"])


def vision_loss_fn(model, batch, train: bool) -> jax.Array:
    """Softmax cross-entropy of an image classifier on {"images", "labels"} batches.

    Uses `classification_loss` rather than optax's: for a label outside
    [0, num_classes) optax gives a NaN loss but a finite gradient, so the
    trainer's non-finite guard let the update through; ours makes the gradient
    NaN too (under jit) and the step is skipped.
    """
    from jaxopt_train.models import classification_loss  # noqa: PLC0415

    return classification_loss(model(batch["images"], train=train), batch["labels"])
