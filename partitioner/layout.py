"""Layouts: which ranks hold which rects of a tensor, as a grid of cells.

A layout cuts a tensor along each dim at sorted cut points; the cells are the boxes between cuts,
numbered row-major, and each cell has a tuple of holders (ranks with a valid copy). Pieces written
by a partitioned task give one holder per cell; a resident tensor's home, derived from its readers,
may give several (a replicated parameter is one cell held by every rank).

Finding the cells a rect overlaps is arithmetic: a bisection of the cuts per dim, then the product
of the index ranges, so a message or a reduction is found without scanning other ranks' pieces.
The holders are kept as a ragged array (`holder_ptr`, `holder_ranks`: the holders of cell i are
`holder_ranks[holder_ptr[i]:holder_ptr[i + 1]]`, sorted), which the planner reads for many cells
at once; `holders` is the same as a dict of tuples, built when first asked for.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import product

import numpy as np

from legion_nn.rect import Rect, split_sizes
from partitioner import boxes


class Layout:
    def __init__(self, cuts: list[list[int]], holders: Mapping[int, tuple[int, ...]]) -> None:
        arrays = [np.asarray(c, boxes.INDEX) for c in cuts]
        ncells = int(np.prod(boxes.grid_shape(arrays), dtype=boxes.INDEX)) if arrays else 0
        cells = np.array([i for i, h in holders.items() for _ in h], boxes.INDEX)
        ranks = np.array([r for h in holders.values() for r in sorted(h)], boxes.INDEX)
        ptr, flat = boxes.csr(cells, ranks, ncells)
        self._init(arrays, ptr, flat)

    def _init(self, cuts: list[np.ndarray], ptr: np.ndarray, ranks: np.ndarray) -> None:
        self.cut_arrays = cuts
        self.cuts = [c.tolist() for c in cuts]
        self.holder_ptr = ptr
        self.holder_ranks = ranks
        self.holder_count = np.diff(ptr)
        self.strides = boxes.grid_strides(cuts)
        self._holders: dict[int, tuple[int, ...]] | None = None
        #: per rank asked for, the rects it holds (`held_by`)
        self._by_rank: dict[int, list[Rect]] = {}
        #: the held cells sorted by holder, (holder, low corner, high corner), on first asking
        self._held_sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._boxes: dict[int, Rect | None] = {}

    @classmethod
    def from_arrays(cls, ndim: int, ranks: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> Layout:
        """The layout where rank `ranks[i]` holds box i; empty boxes hold nothing."""
        keep = boxes.nonempty(lo, hi)
        ranks, lo, hi = ranks[keep], lo[keep], hi[keep]
        cuts = [np.unique(np.concatenate((lo[:, d], hi[:, d]))) for d in range(ndim)]
        first = [np.searchsorted(c, lo[:, d]) for d, c in enumerate(cuts)]
        if len(lo) and all(
            np.array_equal(np.searchsorted(c, hi[:, d]), f + 1)
            for d, (c, f) in enumerate(zip(cuts, first))
        ):
            # every box is one cell (the pieces of a grid): no overlaps to enumerate
            box = np.arange(len(lo), dtype=boxes.INDEX)
            cell = np.ravel_multi_index(first, boxes.grid_shape(cuts)).astype(boxes.INDEX)
        else:
            box, cell, _, _ = boxes.grid_overlaps(cuts, lo, hi)
        ncells = int(np.prod(boxes.grid_shape(cuts), dtype=boxes.INDEX))
        span = int(ranks.max()) + 1 if len(ranks) else 1
        pairs = np.unique(cell * span + ranks[box])
        ptr = np.zeros(ncells + 1, boxes.INDEX)
        np.cumsum(np.bincount(pairs // span, minlength=ncells), out=ptr[1:])
        layout = cls.__new__(cls)
        layout._init(cuts, ptr, pairs % span)
        return layout

    @classmethod
    def from_pieces(cls, ndim: int, pieces: Iterable[tuple[int, Rect]]) -> Layout:
        """The layout where each (rank, rect) holds its rect; empty rects hold nothing."""
        pieces = list(pieces)
        lo, hi = boxes.from_rects([rect for _, rect in pieces], ndim)
        return cls.from_arrays(ndim, np.array([r for r, _ in pieces], boxes.INDEX), lo, hi)

    @property
    def ncells(self) -> int:
        return len(self.holder_count)

    @property
    def holders(self) -> dict[int, tuple[int, ...]]:
        """Cell index -> its holders, for the cells held by anyone."""
        if self._holders is None:
            held = np.flatnonzero(self.holder_count)
            starts = self.holder_ptr[held].tolist()
            ends = self.holder_ptr[held + 1].tolist()
            flat = self.holder_ranks.tolist()
            self._holders = {i: tuple(flat[a:b]) for i, a, b in zip(held.tolist(), starts, ends)}
        return self._holders

    def cell_rect(self, coords: tuple[int, ...]) -> Rect:
        return Rect(
            tuple(c[i] for c, i in zip(self.cuts, coords)),
            tuple(c[i + 1] for c, i in zip(self.cuts, coords)),
        )

    def _spans(self, rect: Rect) -> list[list[tuple[int, int, int]]] | None:
        """Per dim, (index offset, lo, hi) of each cut interval `rect` overlaps; None where it
        overlaps no cell."""
        if rect.is_empty():
            return None
        per_dim = []
        for d, dim_cuts in enumerate(self.cuts):
            lo, hi = rect.lo[d], rect.hi[d]
            first = max(bisect_right(dim_cuts, lo) - 1, 0)
            last = min(bisect_left(dim_cuts, hi), len(dim_cuts) - 1)
            stride = int(self.strides[d])
            spans = [
                (i * stride, max(dim_cuts[i], lo), min(dim_cuts[i + 1], hi))
                for i in range(first, last)
            ]
            spans = [span for span in spans if span[1] < span[2]]
            if not spans:
                return None
            per_dim.append(spans)
        return per_dim

    def cells(self, rect: Rect) -> Iterator[tuple[int, Rect]]:
        """(index, cell ∩ rect) for every cell `rect` overlaps."""
        per_dim = self._spans(rect)
        if per_dim is None:
            return
        for combo in product(*per_dim):
            yield (
                sum(s[0] for s in combo),
                boxes.to_rect(tuple(s[1] for s in combo), tuple(s[2] for s in combo)),
            )

    def cell_indices(self, rect: Rect) -> list[int]:
        """The index of every cell `rect` overlaps, in the order `cells` gives them."""
        per_dim = self._spans(rect)
        if per_dim is None:
            return []
        indices = [0]
        for spans in per_dim:
            indices = [i + span[0] for i in indices for span in spans]
        return indices

    def held_cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(each holder of each held cell, the cell's low corner, its high corner), cell by cell
        in index order, a cell once per holder."""
        cells = np.repeat(np.arange(self.ncells, dtype=boxes.INDEX), self.holder_count)
        coords = np.unravel_index(cells, boxes.grid_shape(self.cut_arrays))
        lo = np.stack([c[i] for c, i in zip(self.cut_arrays, coords)], axis=1)
        hi = np.stack([c[i + 1] for c, i in zip(self.cut_arrays, coords)], axis=1)
        return self.holder_ranks, lo.reshape(len(cells), -1), hi.reshape(len(cells), -1)

    def held_by(self, rank: int) -> list[Rect]:
        """The cells `rank` holds, by index: every rank's cells sorted by holder on first asking,
        a rank's rects made when it is first asked for (programs built once per class of ranks
        ask it of a few ranks: a data-parallel DenseNet-121 on 64 ranks made 38,000 rects of
        replicated parameters for its 3 ranks built)."""
        found = self._by_rank.get(rank)
        if found is None and not len(self.holder_ranks):
            return []
        if found is None:
            if self._held_sorted is None:
                holders, lo, hi = self.held_cells()
                order = np.argsort(holders, kind="stable")
                self._held_sorted = (holders[order], lo[order], hi[order])
            holders, lo, hi = self._held_sorted
            first, end = np.searchsorted(holders, (rank, rank + 1)).tolist()
            rects = boxes.to_rects(lo[first:end], hi[first:end]) if end > first else []
            found = self._by_rank[rank] = rects
        return found

    def held_box(self, rank: int) -> Rect | None:
        """The one box `rank`'s cells fill, where they fill one (the cells are disjoint: their
        volumes add up to their bounding box's); None where they fill none, or it holds none."""
        if rank not in self._boxes:
            held = self.held_by(rank)
            box = Rect.bounding(held)
            if box is not None and sum(cell.volume for cell in held) != box.volume:
                box = None
            self._boxes[rank] = box
        return self._boxes[rank]

    def held(self, rect: Rect) -> Iterator[tuple[Rect, tuple[int, ...]]]:
        """(part of `rect`, its holders) for each cell overlapping it; unheld parts give ()."""
        holders = self.holders
        for index, part in self.cells(rect):
            yield part, holders.get(index, ())

    def cell_volumes(self) -> np.ndarray:
        """Elements of every cell, by index."""
        if self.ncells == 0:
            return np.zeros(0, boxes.INDEX)
        sizes = [np.diff(c) for c in self.cut_arrays]
        return np.prod(np.stack(np.meshgrid(*sizes, indexing="ij")), axis=0).reshape(-1)

    def volume_per_rank(self, nranks: int) -> np.ndarray:
        """Elements held by each of ranks 0..nranks-1."""
        per_cell = np.repeat(self.cell_volumes(), self.holder_count)
        return np.bincount(self.holder_ranks, weights=per_cell, minlength=nranks).astype(
            boxes.INDEX
        )[:nranks]

    def volumes_by_rank(self) -> dict[int, int]:
        """Elements held by each rank that holds any."""
        if len(self.holder_ranks) == 0:
            return {}
        per_rank = self.volume_per_rank(int(self.holder_ranks.max()) + 1)
        held = np.unique(self.holder_ranks)
        return dict(zip(held.tolist(), per_rank[held].tolist()))

    def sharded(self, order: Iterable[int]) -> Layout:
        """This layout with every cell held by several ranks cut among its holders, so that every
        element has one holder (a ZeRO-style home), each part one contiguous block of an
        instance storing the dims in `order`, outermost first (`shard_cell`): a message can carry
        it, and a collective sum it, as it lies."""
        order = list(order)
        grid_shape = boxes.grid_shape(self.cut_arrays)
        pieces: list[tuple[int, Rect]] = []
        for index, holders in self.holders.items():
            rect = self.cell_rect(tuple(int(i) for i in np.unravel_index(index, grid_shape)))
            pieces.extend(shard_cell(rect, holders, order))
        return Layout.from_pieces(len(self.cuts), pieces)


def shard_cell(rect: Rect, holders: Sequence[int], order: Sequence[int]) -> list[tuple[int, Rect]]:
    """`rect` cut into one part per holder (fewer where it has fewer elements), each contiguous
    in an instance storing the dims in `order`, outermost first, the parts in holder order along
    the storage. The first dim of `order` longer than one is cut into a part per holder where it
    is long enough; else into its single indices, the holders shared among them as evenly as
    they go and each index cut further along the dims after it. A part is then some single
    indices, one range, and whole dims after it: contiguous."""
    dims = [d for d in order if rect.shape[d] > 1]
    if len(holders) == 1 or not dims:
        return [(holders[0], rect)]
    dim, extent = dims[0], rect.shape[dims[0]]
    if extent >= len(holders):
        return list(zip(holders, rect.split_dims({dim: len(holders)})))
    out: list[tuple[int, Rect]] = []
    start = 0
    for part, count in zip(rect.split_dims({dim: extent}), split_sizes(len(holders), extent)):
        out += shard_cell(part, holders[start : start + count], dims[1:])
        start += count
    return out
