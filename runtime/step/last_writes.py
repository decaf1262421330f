"""Where each copy of a step is posted: per tensor written this step, the position of the task
in view that last wrote each cell of its layout (`LastWrites`), read by the step's events
(`runtime.step.task_events`) for every copy and every all-gather that brings a task its reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from partitioner import boxes
from partitioner.layout import Layout
from runtime.step.rank_messages import STEP_START


class LastWrites:
    """Per tensor written this step, the position of the task in view that last wrote each cell
    of its layout now (the plan's record, `Plan.written_by`), as an array over the layout's cell
    grid; a tensor not written yet holds what the step started with."""

    def __init__(self, ntasks: int, in_view: Iterable[int]) -> None:
        #: per task index, its position in view (a task out of view, and -1, none: the last)
        self._position = np.full(ntasks + 1, STEP_START, np.int64)
        for position, index in enumerate(in_view):
            self._position[index] = position
        self._written: dict[str, tuple[Layout, np.ndarray]] = {}
        self._grids: dict[str, np.ndarray] = {}

    def record(self, tensor: str, layout: Layout, writers: np.ndarray) -> None:
        """`tensor`'s layout after a task, and the index of the task that last wrote each cell."""
        self._written[tensor] = (layout, writers)
        self._grids.pop(tensor, None)

    def positions(self, tensor: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per rect (`lo[i]`, `hi[i]`) of `tensor`, the position of the task in view that last
        wrote some part of it: the latest over the layout's cells it overlaps (each cut
        interval it meets in every dim), STEP_START for an empty rect or a tensor not written
        yet. A rect within one cell in every dim (a halo, a part of a neighbour's block) is
        read off the grid with the others at once, any other by its slab's max."""
        out = np.full(len(lo), STEP_START, np.int64)
        written = self._written.get(tensor)
        if written is None or not len(lo):
            return out
        layout, writers = written
        grid = self._grids.get(tensor)
        if grid is None:
            grid = self._position[writers].reshape(boxes.grid_shape(layout.cut_arrays))
            self._grids[tensor] = grid
        first = np.empty(lo.shape, np.int64)
        last = np.empty(lo.shape, np.int64)
        for d, cuts in enumerate(layout.cut_arrays):
            first[:, d] = np.maximum(np.searchsorted(cuts, lo[:, d], side="right") - 1, 0)
            last[:, d] = np.minimum(np.searchsorted(cuts, hi[:, d], side="left"), len(cuts) - 1)
        empty = ((first >= last) | (lo >= hi)).any(axis=1)
        single = ~empty & ((last - first) == 1).all(axis=1)
        out[single] = grid[tuple(first[single].T)]
        for i in np.flatnonzero(~empty & ~single).tolist():
            out[i] = grid[tuple(slice(a, b) for a, b in zip(first[i], last[i]))].max()
        return out
