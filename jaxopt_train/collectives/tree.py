"""`all_reduce_tree`: the gradient-pytree all-reduce with a choice of algorithm."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from jaxopt_train.collectives._axis import AxisName, axis_size

METHODS = ("psum", "ring", "ring_bidir", "hierarchical")


def all_reduce_tree(tree: Any, axis_name: AxisName, *, method: str = "psum") -> Any:
    """Sums every leaf of `tree` over `axis_name` (like `lax.psum`), by the chosen algorithm.

    Call inside `jax.shard_map` or `jax.pmap`.
    """
    if method not in METHODS:
        raise ValueError(f"{method=} is not one of {METHODS}")
    axis_size(axis_name)
    if method != "psum":
        raise NotImplementedError(f"{method=} lands in the next commit; use method='psum'")
    return jax.tree.map(lambda x: lax.psum(x, axis_name), tree)
