"""Is an optax optimizer elementwise, so that ZeRO stages 1 and 3 may run it on shards?

Stages 1 and 3 run the optimizer on each device's shard on its own, which
equals the replicated update only if the optimizer's math is per parameter.
An optax optimizer is opaque (a mask or a global norm hides in a closure), so
the check runs it: two updates of small random surrogates of the params,
once on the whole tree and once per shard (vmapped, so each call sees one
shard's shapes, as a device does), and compares them relative to the updates'
size (a warmup from lr 0 makes them tiny). An optimizer that fails on a
shard (a mask shaped like the tree, on a 1-D slice) is reported too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_train.zero.layout import make_layout
from jaxopt_train.zero.leaves import spec_dim


def _surrogate_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
    # Same rank, at most 3 per dimension; the split dimension keeps 1-2 rows per shard.
    return tuple(num_shards * min(size // num_shards, 2) if d == dim else min(size, 3)
                 for d, size in enumerate(shape))


def _two_updates(optimizer: optax.GradientTransformation, params, grads):
    state, out = optimizer.init(params), []
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def elementwise_mismatch(optimizer: optax.GradientTransformation, params, num_shards: int,
                         specs=None, axis_name: str = "data") -> str | None:
    """None if updating shards alone equals updating the whole tree, else where it differs.

    Args:
      optimizer: the optax transformation to test.
      params: the parameters (only the tree structure, ranks and dtypes are read).
      num_shards: devices sharing the parameters.
      specs: `leaf_specs(params, ...)` for the per-leaf layout (shards keep each
        leaf's rank and the tree's structure); None for the flat layout (each
        shard is one 1-D slice of the flattened tree).

    Shape-specific behaviour beyond rank (a mask on one leaf's exact size) is
    not reproduced by the small surrogate and so not detected.
    """
    leaves, treedef = jax.tree.flatten(params)
    dims = ([None] * len(leaves) if specs is None
            else [spec_dim(s, axis_name) for s in treedef.flatten_up_to(specs)])
    rng = np.random.default_rng(0)

    def draw(scale):  # large gradients, so a clip by any usual norm is active
        return treedef.unflatten([
            jnp.asarray(rng.normal(size=_surrogate_shape(tuple(np.shape(x)), d, num_shards)) * scale,
                        x.dtype) for x, d in zip(leaves, dims)])

    grads = [draw(100.0), draw(100.0)]
    if specs is None:
        layout = make_layout(grads[0], num_shards)
        split = lambda t: layout.flatten(t).reshape(num_shards, -1)  # noqa: E731
        join = lambda u: layout.unflatten(u.reshape(-1))  # noqa: E731
    else:
        split = lambda t: treedef.unflatten([  # noqa: E731
            jnp.broadcast_to(x, (num_shards, *x.shape)) if d is None
            else jnp.stack(jnp.split(x, num_shards, axis=d)) for x, d in zip(jax.tree.leaves(t), dims)])
        join = lambda u: treedef.unflatten([  # noqa: E731  (replicated leaves keep every copy)
            x if d is None else jnp.concatenate(list(x), axis=d) for x, d in zip(jax.tree.leaves(u), dims)])

    @jax.jit
    def both(p, grads):
        whole = _two_updates(optimizer, p, grads)
        shards = jax.vmap(lambda p, g: _two_updates(optimizer, p, g))(split(p), [split(g) for g in grads])
        return whole, [join(u) for u in shards]

    # Params near 1 show a global norm or trust ratio; params of ~1e3 make a weight decay of
    # any usual factor (optax's default 1e-4 too) outweigh rounding, so a per-leaf mask that a
    # shard sees wrongly shows. The second run reuses the first's compilation.
    for param_scale in (1.0, 1e3):
        p = draw(param_scale)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            try:
                whole, sharded = both(p, grads)
            except Exception as err:  # noqa: BLE001  (e.g. a mask tree that a 1-D slice cannot match)
                jax.jit(lambda p, g: _two_updates(optimizer, p, g))(p, grads)  # its own errors raise
                cause = " ".join(str(err).split())
                return (f"running it on one shard's parameters fails: {type(err).__name__}: "
                        f"{cause[:300]}{'...' if len(cause) > 300 else ''}")
        mismatch = _first_difference(whole, sharded, num_shards, param_scale)
        if mismatch:
            return mismatch
    return None


def _first_difference(whole, sharded, num_shards: int, param_scale: float) -> str | None:
    for step, (w, s) in enumerate(zip(whole, sharded)):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(s)):
            # f32: 1e-3, not less: a schedule-free optimizer's updates are differences of
            # params, which two programs round apart by an ulp of the params (~1.5e-4 of the
            # update here); what the check must catch differs by percents (a per-shard clip,
            # a mask a 1-D slice gets wrong: a weight decay ~10% of the update at ~1e3).
            rtol = 1e-3 if np.dtype(a.dtype).itemsize >= 4 else 1e-2
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            scale = float(np.max(np.abs(a), initial=0.0))
            diff = float(np.max(np.abs(b - a), initial=0.0))  # b broadcasts for replicated leaves
            # Relative to the updates with no absolute floor: a warmup from lr 0 makes them
            # tiny (update 2 of warmup_cosine_decay_schedule(0, 3e-4, 2000, ...) is ~1e-7),
            # and a floor would pass the differences below it. Updates of exactly 0 (lr 0) must
            # match exactly.
            if not diff <= rtol * scale:
                return (f"on random gradients and params of size ~{param_scale:g}, update "
                        f"{step + 1} of leaf {jax.tree_util.keystr(path)} differs by up to "
                        f"{diff:.3g} (updates up to {scale:.3g}) when each of {num_shards} shards "
                        "is updated on its own")
    return None
