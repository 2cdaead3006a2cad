"""The train state and the default optimizer.

`TrainState` is a NamedTuple pytree, so it passes through `jax.jit`,
`jax.shard_map` and orbax unchanged. Everything that must survive a resume
lives here; the step number also fixes the data order (`batch(step)`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TrainState(NamedTuple):
    """Attributes:
    step: int32 optimizer steps taken (skipped non-finite steps included).
    params: trainable weights in the policy's param dtype.
    model_state: non-trainable model variables (BatchNorm statistics).
    opt_state: the optax state.
    loss_scale: a `jaxopt_train.precision` loss scale (NoOp unless fp16).
    nonfinite_streak: int32 consecutive steps whose gradients were not finite.
    grad_error: the error-feedback state of compressed gradient reduction
      (`jaxopt_train.collectives.ErrorFeedbackState`, f32 leaves shaped
      [devices, *param.shape], sharded over the data axis: each device keeps
      the rounding error of its own contribution), or None without compression.
      Kept here so the correction persists across steps and checkpoints.
    """

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    loss_scale: Any
    nonfinite_streak: jax.Array
    grad_error: Any = None


def init_train_state(params, model_state, optimizer: optax.GradientTransformation,
                     loss_scale, grad_error=None) -> TrainState:
    # Jitted: an eager init may keep the params' own buffers in its state (optax.contrib's
    # prodigy keeps params0=params), and the donated state would then hold one buffer twice.
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                      opt_state=jax.jit(optimizer.init)(params), loss_scale=loss_scale,
                      nonfinite_streak=jnp.zeros((), jnp.int32), grad_error=grad_error)


# Flax's names for biases and norm scales (nnx and linen: Linear, Conv, LayerNorm, BatchNorm, RMSNorm).
_NO_DECAY_NAMES = ("bias", "scale")


def _leaf_name(path) -> str | None:
    """The parameter's own name: the last dict key or attribute of `path`, past an nnx
    Variable's "value"."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name != "value":
            return name
    return None


def _decay_mask(params):
    # No weight decay on biases, norm scales and other vectors (GPT-2/nanoGPT). By name too,
    # not only by rank: stacked layers (scan_layers, nn.scan) give each bias and scale a
    # leading layer axis, and a rank test alone decayed them (a scanned model trained
    # unlike its unrolled copy).
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.ndim(p) >= 2 and _leaf_name(path) not in _NO_DECAY_NAMES, params)


def default_optimizer(*, lr: float, total_steps: int, warmup: int = 0, weight_decay: float = 0.1,
                      clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95
                      ) -> optax.GradientTransformation:
    """AdamW on a linear-warmup cosine schedule (to lr/10), after global-norm clipping.

    `clip_norm=0` disables clipping. The schedule's cosine spans `total_steps`.
    """
    for name, value in (("lr", lr), ("clip_norm", clip_norm), ("weight_decay", weight_decay),
                        ("b1", b1), ("b2", b2)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r} must be a number")
    if not 0 < lr < math.inf:
        raise ValueError(f"lr={lr} must be a finite number > 0")
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} must be an int >= 1")
    # optax takes these silently: a negative warmup bends the schedule (it started at
    # 0.78 * lr and only fell), and clip_by_global_norm(-c) multiplies every clipped
    # gradient by -c/|g|, i.e. gradient ascent.
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0 (steps of linear warmup)")
    total_steps, warmup = int(total_steps), int(warmup)  # numpy numbers welcome
    lr, clip_norm, weight_decay, b1, b2 = (float(x) for x in (lr, clip_norm, weight_decay, b1, b2))
    if not 0 <= clip_norm < math.inf:
        raise ValueError(f"clip_norm={clip_norm!r} must be a finite number >= 0 (0 disables "
                         "clipping)")
    if not 0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite number >= 0")
    for name, beta in (("b1", b1), ("b2", b2)):  # b2=1: Adam's bias correction is 0/0
        if not 0 <= beta < 1:
            raise ValueError(f"{name}={beta!r} must be in [0, 1)")
    warmup = min(warmup, total_steps - 1) if total_steps > 1 else 0
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else lr, peak_value=lr, warmup_steps=warmup,
        decay_steps=total_steps, end_value=lr / 10)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=_decay_mask)
    if clip_norm:
        return optax.chain(clip_by_global_norm_f32(clip_norm), adamw)
    return adamw


def global_norm_f32(tree) -> jax.Array:
    """`optax.global_norm`, with each leaf's squares summed in float32 (float64 leaves in
    float64). optax sums in the leaves' dtype: bf16 gradients (bf16-pure params) gave
    11.0625 for 11.0715, so the clip of the replicated step and the ZeRO step's (f32) differed."""
    def squares(x):
        x = jnp.asarray(x)
        if jnp.iscomplexobj(x):
            x = jnp.abs(x)
        wide = x.dtype if jnp.dtype(x.dtype).itemsize > 4 else jnp.float32
        return jnp.sum(jnp.square(x.astype(wide)))
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(squares(x) for x in leaves)) if leaves else jnp.float32(0)


def clip_to_norm(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm's formula with the whole gradient's `norm` given: the
    replicated step's clip and the ZeRO step's (whose norm is summed over shards)."""
    return jax.tree.map(lambda g: jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype))
                                                 * jnp.asarray(max_norm, g.dtype)), grads)


def clip_by_global_norm_f32(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm(max_norm)` with the norm from `global_norm_f32`."""
    def update(updates, state, params=None):
        del params
        return clip_to_norm(updates, global_norm_f32(updates), max_norm), state
    return optax.GradientTransformation(optax.init_empty_state, update)


def param_count(params) -> int:
    return int(sum(jnp.size(x) for x in jax.tree.leaves(params)))
