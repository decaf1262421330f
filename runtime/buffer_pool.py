"""Scratch arrays kept from one step to the next.

A rank's reduction scratch, message buffers and collective hop buffers have the same shapes every
step. Allocating them afresh costs a page fault per 4 KiB page the first time each is written: for
a seed-lcn weight gradient (585 MB) that was 0.1-2 s a step, varying with what the rest of the
machine was doing, against about 0.04 s to refill a buffer that is already mapped. The pool hands
back the same memory for the same key, so the faults are paid once.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from runtime.aligned import aligned_empty


class BufferPool:
    def __init__(self) -> None:
        self._arrays: dict[Hashable, np.ndarray] = {}

    def get(self, key: Hashable, shape: tuple[int, ...], dtype, zero: bool = False) -> np.ndarray:
        """A C-contiguous array of `shape`: the one last handed out for `key` when it fits.

        Its contents are whatever the last user left unless `zero`. A caller must be done with
        the previous array of a key before asking for it again."""
        size = math.prod(shape)
        dtype = np.dtype(dtype)
        array = self._arrays.get(key)
        if array is None or array.dtype != dtype or array.size < size:
            array = self._arrays[key] = aligned_empty((size,), dtype)
        view = array[:size].reshape(shape)
        if zero:
            view.fill(0)
        return view

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self._arrays.values())
