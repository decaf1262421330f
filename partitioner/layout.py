"""Layouts: which ranks hold which rects of a tensor, as a grid of cells.

A layout cuts a tensor along each dim at sorted cut points; the cells are the boxes between cuts,
numbered row-major, and each cell has a tuple of holders (ranks with a valid copy). Pieces written
by a partitioned task give one holder per cell; a resident tensor's home, derived from its readers,
may give several (a replicated parameter is one cell held by every rank).

Finding the cells a rect overlaps is arithmetic: a bisection of the cuts per dim, then the product
of the index ranges, so a message or a reduction is found without scanning other ranks' pieces.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from itertools import product

from legion_nn.rect import Rect


class Layout:
    def __init__(self, cuts: list[list[int]], holders: dict[int, tuple[int, ...]]) -> None:
        self.cuts = cuts
        self.holders = holders
        self._strides = []
        stride = 1
        for dim_cuts in reversed(cuts):
            self._strides.append(stride)
            stride *= max(len(dim_cuts) - 1, 0)
        self._strides.reverse()

    @classmethod
    def from_pieces(cls, ndim: int, pieces: Iterable[tuple[int, Rect]]) -> Layout:
        """The layout where each (rank, rect) holds its rect; empty rects hold nothing."""
        pieces = [(rank, rect) for rank, rect in pieces if not rect.is_empty()]
        cut_sets: list[set[int]] = [set() for _ in range(ndim)]
        for _, rect in pieces:
            for d in range(ndim):
                cut_sets[d].update((rect.lo[d], rect.hi[d]))
        layout = cls([sorted(c) for c in cut_sets], {})
        found: dict[int, list[int]] = {}
        for rank, rect in pieces:
            for index, _ in layout.cells(rect):
                found.setdefault(index, []).append(rank)
        layout.holders = {i: tuple(sorted(set(r))) for i, r in found.items()}
        return layout

    def cell_rect(self, coords: tuple[int, ...]) -> Rect:
        return Rect(
            tuple(c[i] for c, i in zip(self.cuts, coords)),
            tuple(c[i + 1] for c, i in zip(self.cuts, coords)),
        )

    def cells(self, rect: Rect) -> Iterator[tuple[int, Rect]]:
        """(index, cell ∩ rect) for every cell `rect` overlaps."""
        if rect.is_empty():
            return
        per_dim = []
        for d, dim_cuts in enumerate(self.cuts):
            lo, hi = rect.lo[d], rect.hi[d]
            first = max(bisect_right(dim_cuts, lo) - 1, 0)
            last = min(bisect_left(dim_cuts, hi), len(dim_cuts) - 1)
            spans = [
                (i * self._strides[d], max(dim_cuts[i], lo), min(dim_cuts[i + 1], hi))
                for i in range(first, last)
            ]
            spans = [span for span in spans if span[1] < span[2]]
            if not spans:
                return
            per_dim.append(spans)
        for combo in product(*per_dim):
            yield (
                sum(s[0] for s in combo),
                _trusted_rect(tuple(s[1] for s in combo), tuple(s[2] for s in combo)),
            )

    def held(self, rect: Rect) -> Iterator[tuple[Rect, tuple[int, ...]]]:
        """(part of `rect`, its holders) for each cell overlapping it; unheld parts give ()."""
        for index, part in self.cells(rect):
            yield part, self.holders.get(index, ())

    def volumes_by_rank(self) -> dict[int, int]:
        """Elements held by each rank that holds any."""
        out: dict[int, int] = {}
        for index, holders in self.holders.items():
            volume = self.cell_rect(self._coords(index)).volume
            for rank in holders:
                out[rank] = out.get(rank, 0) + volume
        return out

    def _coords(self, index: int) -> tuple[int, ...]:
        return tuple((index // s) % (len(c) - 1) for s, c in zip(self._strides, self.cuts))


def _trusted_rect(lo: tuple[int, ...], hi: tuple[int, ...]) -> Rect:
    """A Rect from bounds already known to be int tuples of equal rank.

    Planning 1024 ranks creates about a million of these; skipping `Rect.__post_init__`'s
    conversions halves the planning time."""
    rect = object.__new__(Rect)
    object.__setattr__(rect, "lo", lo)
    object.__setattr__(rect, "hi", hi)
    return rect
