"""Cross-entropy losses for the models: a float32 softmax cross-entropy with a lean
gradient (`softmax_cross_entropy`), its mean over tokens (`gpt_loss`), and the
range check that keeps an id outside [0, vocab) from passing as a real one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-position ``logsumexp(logits) - logits[target]`` in float32, with a one-pass gradient.

    Same value as `optax.softmax_cross_entropy_with_integer_labels` on the
    f32-cast logits. The custom VJP is why it exists: the gradient
    ``(softmax - onehot) * g`` is computed in one elementwise pass from the
    saved logits and logsumexp and written straight in the logits' dtype. Left
    to autodiff, XLA materialised an f32 [batch, time, vocab] gradient and then
    converted it: on gpt-1b (batch 8, H200) this VJP cut the step's temporaries
    from 14.10 to 13.36 GiB; its step time stayed within run-to-run noise.
    """
    return _xent_forward(logits, targets)[0]


def _xent_forward(logits, targets):
    x = logits.astype(jnp.float32)
    # logsumexp as top + log(sum(exp(x - top))), with both parts kept for the backward:
    # rebuilding the softmax from the rounded sum lse = top + log_sum lost lse's low
    # bits (f32's spacing is 0.06 at 1e6), and at such logits the gradient's rows no
    # longer summed to 0. x - top is exact for the large logits that matter.
    top = jnp.max(x, axis=-1)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))  # an all -inf row: NaN-free shift
    log_sum = jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
    lse = top + log_sum
    # A target outside [0, vocab) (e.g. -100 as an ignore index, which we do not
    # support) must not wrap round to a real class: its loss and gradient are NaN,
    # which the trainer's finite check reports, instead of a plausible number. Checked
    # in the targets' own dtype: under x64 an int64 2**32 + 5 cast first read class 5.
    valid = (targets >= 0) & (targets < x.shape[-1])
    targets = jnp.where(valid, targets, -1).astype(jnp.int32)  # the backward sees -1: invalid
    picked = jnp.take_along_axis(x, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    # (x - top) - log_sum rather than x - lse: see above.
    loss = jnp.where(valid, (top - picked) + log_sum, jnp.nan)
    return loss, (logits, targets, top, log_sum)


def _xent_backward(residuals, g):
    logits, targets, top, log_sum = residuals
    probs = jnp.exp((logits.astype(jnp.float32) - top[..., None]) - log_sum[..., None])
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    onehot = (vocab == targets[..., None]).astype(jnp.float32)
    valid = ((targets >= 0) & (targets < logits.shape[-1]))[..., None]
    grad = jnp.where(valid, (probs - onehot) * g.astype(jnp.float32)[..., None], jnp.nan).astype(logits.dtype)
    # Integer targets have no cotangent (None: a symbolic zero).
    return grad, None


softmax_cross_entropy.defvjp(_xent_forward, _xent_backward)


def gpt_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32 (`softmax_cross_entropy`).

    Args:
      logits: [..., vocab] in any float dtype.
      targets: integer ids with the shape of ``logits`` minus its last axis.

    Returns:
      A float32 scalar.
    """
    given = targets  # host ids are range-checked as given: without x64 jnp.asarray wraps 2**32 to 0
    logits, targets = jnp.asarray(logits), jnp.asarray(targets)  # lists: a message, not .shape
    if not jnp.issubdtype(logits.dtype, jnp.floating) or logits.ndim < 1:
        # Integer logits gave a finite loss that no gradient can follow (class scores are real).
        raise ValueError(f"logits must be a floating array [..., vocab], got shape={logits.shape} "
                         f"dtype={logits.dtype}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {targets.shape} must equal logits shape without the vocab "
            f"axis {logits.shape[:-1]}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype={targets.dtype}")
    if targets.size == 0:  # the mean of nothing is NaN, which would look like a diverged run
        raise ValueError(f"gpt_loss needs at least one target token; got targets shape {targets.shape}")
    # A NumPy scalar is a host id too: np.int64(2**32 + 1) wrapped to class 1, a finite loss.
    host = isinstance(given, (np.ndarray, np.generic))
    check_ids_in_range(given if host else targets, logits.shape[-1], "targets")
    return jnp.mean(softmax_cross_entropy(logits, targets))


def check_ids_in_range(ids, upper: int, what: str) -> None:
    """Raises ValueError if concrete integer `ids` leave [0, upper).

    Traced ids (inside jit or grad), and a global array spanning other hosts' devices,
    cannot be checked here; there an id out of range makes the embedding row or the
    loss NaN instead (see `embed` and `softmax_cross_entropy`), so it still shows
    rather than passing as a real id.
    """
    if isinstance(ids, jax.core.Tracer):
        return  # (reading is_fully_addressable below would raise on a tracer)
    if getattr(ids, "is_fully_addressable", True) is False:
        return  # a multi-host global array: this process cannot read the other hosts' ids
    try:
        values = np.asarray(ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if values.size and (values.min() < 0 or values.max() >= upper):
        raise ValueError(f"{what} must be ids in [0, {upper}); got values from {values.min()} to "
                         f"{values.max()} (ignore-index values such as -100 are not supported)")
