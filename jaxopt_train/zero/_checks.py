"""Argument checks shared by the flat and the per-leaf ZeRO layouts."""

from __future__ import annotations

import jax

from jaxopt_train._checks import is_int


STAGES = (0, 1, 3)
METHODS = ("psum", "ring")


def _check_num_shards(num_shards: int) -> None:
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"{num_shards=} must be a positive int (the size of the data axis)")


def _check_has_leaves(leaves: list, what: str) -> None:
    """Raises ValueError for a tree without leaves (a model that built no parameters)."""
    if not leaves:
        raise ValueError(f"{what}: expected at least one array leaf, got an empty tree; pass the "
                         "model's parameters (e.g. nnx.state(model, nnx.Param))")


def _check_axis_name(axis_name: str) -> None:
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"{axis_name=} must be a non-empty str naming the mesh axis (e.g. 'data')")


def _mesh_axis_size(mesh: jax.sharding.Mesh, axis_name: str) -> int:
    _check_axis_name(axis_name)
    if axis_name not in mesh.shape:
        raise ValueError(f"{axis_name=} is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}; "
                         "pass one of them as axis_name")
    return mesh.shape[axis_name]


def _check(stage: int, method: str):
    if not is_int(stage) or stage not in STAGES:
        raise ValueError(f"{stage=} must be one of {STAGES} (0: replicated, 1: optimizer state, 3: + params)")
    if method not in METHODS:
        raise ValueError(f"{method=} must be one of {METHODS}")
