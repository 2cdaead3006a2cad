"""jaxopt_train: fast, measured large-model training on JAX/XLA.

Public API re-exports only, imported on first use (PEP 562): `import jaxopt_train` (and
so `jaxopt-train --help`, or a Ctrl-C in a command's first second) does not wait for
JAX. Importing this package starts no JAX backend and sets no XLA flags; subpackages
(models, data, train, kernels, collectives, zero, runtime, bench) hold the rest of the API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that owns it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("accumulate_gradients", "check_divisible", "data_parallel_value_and_grad",
                     "multi_steps"), "accumulation"),
    **dict.fromkeys(("all_reduce_tree", "hierarchical_all_reduce", "ring_all_gather",
                     "ring_all_reduce", "ring_reduce_scatter"), "collectives"),
    **dict.fromkeys(("DynamicLossScale", "NoOpLossScale", "Policy", "StaticLossScale", "all_finite",
                     "apply_updates_if_finite", "get_policy", "linen_apply", "loss_scale_for",
                     "nnx_apply", "select_tree"), "precision"),
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports it
    from jaxopt_train.accumulation import (accumulate_gradients, check_divisible,
                                           data_parallel_value_and_grad, multi_steps)
    from jaxopt_train.collectives import (all_reduce_tree, hierarchical_all_reduce, ring_all_gather,
                                          ring_all_reduce, ring_reduce_scatter)
    from jaxopt_train.precision import (DynamicLossScale, NoOpLossScale, Policy, StaticLossScale,
                                        all_finite, apply_updates_if_finite, get_policy, linen_apply,
                                        loss_scale_for, nnx_apply, select_tree)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"jaxopt_train.{_EXPORTS[name]}"), name)
    else:
        # `jaxopt_train.precision` after a bare `import jaxopt_train` worked while this file
        # imported its modules eagerly; a subpackage or module name still does.
        try:
            value = importlib.import_module(f"jaxopt_train.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"jaxopt_train.{name}":
                raise  # the module exists but something it imports does not
            raise AttributeError(f"module 'jaxopt_train' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
