"""Type predicates shared by the boundary checks of several modules."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool: counts often come from numpy (np.prod of a mesh
    shape, labels.max() + 1), while True, 1.0 or "1" are not counts even where they equal 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
