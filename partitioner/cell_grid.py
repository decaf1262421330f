"""Counting boxes on the grid cut at their bounds, for checks over many boxes (`verify_plan.py`).

`CellGrid` cuts space at every bound of some boxes (coordinate compression): each resulting
cell lies wholly inside or outside each box. It counts how many boxes of a group cover each cell
with an N-d difference array, and sums the volume of the cells where a mask holds over each box
with a summed-volume table, so a check costs about the number of cells rather than the square
of the number of boxes. Boxes may lie in layers (one per rank), each counted apart on the same
cuts, so that the checks of many ranks are one pass over arrays. `join` pairs equal keys of two
arrays, all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise, product

import numpy as np

from legion_nn.rect import Rect
from partitioner import boxes


def join(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (i, j) with `left[i] == right[j]`, i ascending."""
    order = np.argsort(right, kind="stable")
    ordered = right[order]
    start = np.searchsorted(ordered, left, "left")
    count = np.searchsorted(ordered, left, "right") - start
    i = np.repeat(np.arange(len(left), dtype=boxes.INDEX), count)
    first = np.cumsum(count) - count
    j = order[np.repeat(start - first, count) + np.arange(len(i), dtype=boxes.INDEX)]
    return i, j


class CellGrid:
    """The grid cut at every bound of boxes `lo`, `hi` (groups of `sizes` boxes, one after
    another), in `nlayers` layers (box i lies in layer `layer[i]`, by default 0): cell i along
    dim d is [cuts[d][i], cuts[d][i + 1]); the last index along each dim is the outside
    beyond the last cut. Counts and masks have the layer as their first axis.

    Every box's bounds become cell indices once; its 2^ndim corners are then flat indices into
    an array of cells, for all boxes and corners at once."""

    def __init__(
        self,
        lo: np.ndarray,
        hi: np.ndarray,
        sizes: Sequence[int],
        layer: np.ndarray | None = None,
        nlayers: int = 1,
    ) -> None:
        self.lo, self.hi = lo, hi
        self.ndim = self.lo.shape[1]
        self.nlayers = nlayers
        self.cuts = [
            np.unique(np.concatenate((self.lo[:, d], self.hi[:, d]))) for d in range(self.ndim)
        ]
        self.shape = tuple(len(c) for c in self.cuts)
        self.size = nlayers * int(np.prod(self.shape))
        self.volume = np.ones(self.shape, np.int64)
        for d, c in enumerate(self.cuts):
            size = np.append(np.diff(c), 0)
            self.volume = self.volume * size.reshape(
                [-1 if e == d else 1 for e in range(self.ndim)]
            )
        ends = np.cumsum([0, *sizes]).tolist()
        self._groups = list(pairwise(ends))
        self._layer = layer if layer is not None else np.zeros(ends[-1], np.int64)
        #: per group, the index of each of its boxes in the caller's list of the group
        self.rows = [np.arange(size) for size in sizes]
        self._first = np.stack([np.searchsorted(c, self.lo[:, d]) for d, c in enumerate(self.cuts)])
        self._last = np.stack([np.searchsorted(c, self.hi[:, d]) for d, c in enumerate(self.cuts)])
        self._nonempty = np.all(self.hi > self.lo, axis=1)
        #: per corner, whether it takes each dim's upper bound, and its inclusion-exclusion sign
        self._upper = np.array(list(product((False, True), repeat=self.ndim))).reshape(
            -1, self.ndim
        )
        self._sign = np.where(self._upper.sum(axis=1) % 2, -1, 1)

    @classmethod
    def of(cls, *groups: list[Rect]) -> CellGrid:
        """The grid of some groups of boxes, in one layer."""
        lo, hi = arrays([rect for group in groups for rect in group])
        return cls(lo, hi, [len(group) for group in groups])

    def one_layer(self, layer: int) -> CellGrid:
        """The grid of the boxes in `layer` alone, cut at their bounds only."""
        picks = [np.flatnonzero(self._layer[self._span(g)] == layer) for g in range(len(self.rows))]
        every = np.concatenate([pick + self._groups[g][0] for g, pick in enumerate(picks)])
        grid = CellGrid(self.lo[every], self.hi[every], [len(pick) for pick in picks])
        grid.rows = [rows[pick] for rows, pick in zip(self.rows, picks)]
        return grid

    def _span(self, group: int) -> slice:
        return slice(*self._groups[group])

    def layer(self, group: int) -> np.ndarray:
        """The layer of each box of the group."""
        return self._layer[self._span(group)]

    def volumes(self, group: int) -> np.ndarray:
        span = self._span(group)
        return np.prod(np.maximum(self.hi[span] - self.lo[span], 0), axis=1)

    def _corners(self, group: int, shape: tuple[int, ...]) -> np.ndarray:
        """Flat indices, in an array of (layers, *`shape`), of the corners (rows) of the group's
        boxes."""
        span = self._span(group)
        flat = self._layer[span] * int(np.prod(shape))
        flat = np.broadcast_to(flat, (len(self._upper), len(flat))).copy()
        stride = 1
        for d in range(self.ndim - 1, -1, -1):
            flat += stride * np.where(
                self._upper[:, d, None], self._last[d, span], self._first[d, span]
            )
            stride *= shape[d]
        return flat

    def count(self, group: int) -> np.ndarray:
        """How many boxes of the group cover each cell (an N-d difference array)."""
        flat = self._corners(group, self.shape)[:, self._nonempty[self._span(group)]]
        plus = np.bincount(flat[self._sign > 0].ravel(), minlength=self.size)
        minus = np.bincount(flat[self._sign < 0].ravel(), minlength=self.size)
        count = (plus - minus).reshape(self.nlayers, *self.shape)
        for axis in range(1, self.ndim + 1):
            np.cumsum(count, axis=axis, out=count)
        return count

    def volume_where(self, mask: np.ndarray, group: int) -> np.ndarray:
        """For each box of the group, the volume of its cells (in its layer) where `mask`
        holds, from a summed-volume table; 0 for an empty box."""
        table = np.zeros((self.nlayers, *(n + 1 for n in self.shape)), np.int64)
        table[(slice(None), *[slice(1, None)] * self.ndim)] = np.where(mask, self.volume, 0)
        for axis in range(1, self.ndim + 1):
            np.cumsum(table, axis=axis, out=table)
        sign = self._sign if self.ndim % 2 == 0 else -self._sign
        corners = self._corners(group, table.shape[1:])
        out = (table.ravel()[corners] * sign[:, None]).sum(axis=0)
        return np.where(self._nonempty[self._span(group)], out, 0)

    def inside_one(self, group: int, within: int) -> np.ndarray:
        """For each box of `group`, whether it lies inside one box of `within` in its layer."""
        inner, outer = self._span(group), self._span(within)
        i, j = join(self._layer[inner], self._layer[outer])
        lo, hi = self.lo[inner][i], self.hi[inner][i]
        inside = np.all((self.lo[outer][j] <= lo) & (hi <= self.hi[outer][j]), axis=1)
        return np.bincount(i[inside], minlength=inner.stop - inner.start) > 0


def arrays(rects: list[Rect]) -> tuple[np.ndarray, np.ndarray]:
    ndim = rects[0].ndim
    lo = np.array([r.lo for r in rects], np.int64).reshape(len(rects), ndim)
    hi = np.array([r.hi for r in rects], np.int64).reshape(len(rects), ndim)
    return lo, hi
