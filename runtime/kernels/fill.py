"""The `set_zero` op: clears a gradient before its pieces are accumulated into it.

Kept as a kernel of its own because the executor dispatches every task by op name; `fill(0)` on
the view is already a memset, so there is nothing for Numba to add, and it works in place on
strided pieces too.
"""

from __future__ import annotations

import numpy as np


def set_zero(array: np.ndarray) -> None:
    """Zero `array` in place."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a numpy array, got {type(array).__name__}")
    if not array.flags.writeable:
        raise ValueError(f"array of shape {array.shape} is read-only")
    array.fill(0)
