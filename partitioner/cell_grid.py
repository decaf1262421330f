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
        self.nlayers = nlayers
        # dims every box spans alike are left out of the grid, their extent a factor of every
        # cell's volume: a weight's shards cut one dim of eight, and 2^7 corners would cost more
        # than the boxes
        same = np.all((lo == lo[:1]) & (hi == hi[:1]), axis=0) & (len(lo) > 0)
        same[: 1 if same.all() else 0] = False  # a grid keeps one dim
        varied = np.flatnonzero(~same)
        factor = int(np.prod(np.maximum(hi[0] - lo[0], 0)[same])) if same.any() else 1
        lo, hi = lo[:, varied], hi[:, varied]
        self.ndim = lo.shape[1]
        self.cuts = [np.unique(np.concatenate((lo[:, d], hi[:, d]))) for d in range(self.ndim)]
        self.shape = tuple(len(c) for c in self.cuts)
        self.size = nlayers * int(np.prod(self.shape))
        self.volume = np.full(self.shape, factor, np.int64)
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
        self._first = np.stack([np.searchsorted(c, lo[:, d]) for d, c in enumerate(self.cuts)])
        self._last = np.stack([np.searchsorted(c, hi[:, d]) for d, c in enumerate(self.cuts)])
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

    def by_layer(self) -> list[CellGrid]:
        """Per layer, the grid of its boxes alone, cut at their bounds only."""
        order = np.argsort(self._layer, kind="stable")  # each layer's boxes in group order
        starts = np.searchsorted(self._layer[order], np.arange(self.nlayers + 1))
        group = np.searchsorted([end for _, end in self._groups], order, side="right")
        out = []
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            every = order[a:b]
            sizes = np.bincount(group[a:b], minlength=len(self._groups))
            grid = CellGrid(self.lo[every], self.hi[every], sizes.tolist())
            grid.rows = [
                every[group[a:b] == g] - self._groups[g][0] for g in range(len(self._groups))
            ]
            out.append(grid)
        return out

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
        """How many boxes of the group cover each cell."""
        return self.counts([group])[0]

    def counts(self, groups: Sequence[int]) -> np.ndarray:
        """`count` of each of `groups`, stacked (one N-d difference array, summed at once)."""
        size = self.size
        flat = [
            self._corners(g, self.shape)[:, self._nonempty[self._span(g)]] + k * size
            for k, g in enumerate(groups)
        ]
        plus = np.concatenate([f[self._sign > 0].ravel() for f in flat])
        minus = np.concatenate([f[self._sign < 0].ravel() for f in flat])
        total = len(groups) * size
        count = np.bincount(plus, minlength=total) - np.bincount(minus, minlength=total)
        count = count.reshape(len(groups), self.nlayers, *self.shape)
        for axis in range(2, self.ndim + 2):
            np.cumsum(count, axis=axis, out=count)
        return count

    def volume_where(self, mask: np.ndarray, group: int) -> np.ndarray:
        """For each box of the group, the volume of its cells (in its layer) where `mask`
        holds; 0 for an empty box."""
        return self.volumes_where(mask[None], group)[0]

    def volumes_where(self, masks: np.ndarray, group: int) -> np.ndarray:
        """`volume_where` of each of `masks` (stacked), from one stack of summed-volume tables."""
        table = np.zeros((len(masks), self.nlayers, *(n + 1 for n in self.shape)), np.int64)
        table[(slice(None), slice(None), *[slice(1, None)] * self.ndim)] = np.where(
            masks, self.volume, 0
        )
        for axis in range(2, self.ndim + 2):
            np.cumsum(table, axis=axis, out=table)
        sign = self._sign if self.ndim % 2 == 0 else -self._sign
        corners = self._corners(group, table.shape[2:])
        out = (table.reshape(len(masks), -1)[:, corners] * sign[:, None]).sum(axis=1)
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
