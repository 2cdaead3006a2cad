"""Pytree leaf paths for error messages that name the leaf where two trees differ."""

from __future__ import annotations

from typing import Any

import jax


def leaf_paths(tree: Any) -> list[str]:
    """The key path of every leaf of `tree` (`jax.tree_util.keystr`, e.g. "['w']"), in tree order."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_path_diff(given: Any, expected_treedef) -> tuple[list[str], list[str]]:
    """(paths of `expected_treedef`'s leaves that `given` lacks, paths of `given`'s leaves
    that `expected_treedef` lacks), each in tree order. Both empty when only the containers
    differ (a tuple for a list): then only the treedefs tell."""
    expected = leaf_paths(jax.tree.unflatten(expected_treedef, range(expected_treedef.num_leaves)))
    given_paths = leaf_paths(given)
    expected_set, given_set = set(expected), set(given_paths)
    return [p for p in expected if p not in given_set], [p for p in given_paths if p not in expected_set]
