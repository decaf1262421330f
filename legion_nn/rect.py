"""N-d boxes: the geometry every region requirement, piece and message is made of.

A `Rect` is an immutable value with `lo` inclusive and `hi` exclusive, both tuples of ints. An empty
rect (some `hi[d] <= lo[d]`) is a legal value of volume 0; operations that produce one keep the
bounds they computed, and `intersect` of disjoint boxes returns an empty rect, never an exception.

The `repr` reproduces the seed's printing of its region rects, which wrapped int32 NumPy arrays:
``Rect(array([0, 0], dtype=int32), array([256, 1], dtype=int32))``, with single spaces (the form
docs/formats.md fixes; NumPy itself would pad the columns). Conversion between this
inclusive/exclusive form and anything else happens only in `to_slices`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import product
from operator import le


def split_sizes(extent: int, parts: int) -> list[int]:
    """Near-equal sizes of `parts` pieces of `extent`, larger pieces first (27 over 4 -> 7,7,7,6)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(extent, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def split_bounds(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """The `(lo, hi)` bounds of `split_sizes` laid end to end from `lo`."""
    bounds = []
    start = lo
    for size in split_sizes(max(hi - lo, 0), parts):
        bounds.append((start, start + size))
        start += size
    return bounds


def _format_array(values: Sequence[int]) -> str:
    """The seed's printing of an int32 NumPy vector, with single spaces (docs/formats.md)."""
    return "array([" + ", ".join(str(v) for v in values) + "], dtype=int32)"


_set_field = object.__setattr__


@dataclass(frozen=True, slots=True, init=False)
class Rect:
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    #: whether some dim is empty, found once as the rect is made: a rank's program asks it of
    #: every rect it is told, some 10⁶ times for ResNet-18's 64 ranks
    _empty: bool = field(default=False, init=False, compare=False, repr=False)

    def __init__(self, lo: Iterable[int], hi: Iterable[int]) -> None:
        # written out rather than a dataclass __init__ plus __post_init__: the access maps build
        # some 10⁵ rects while planning 1024 ranks, and that pair sets each field twice
        lo = tuple(map(int, lo))
        hi = tuple(map(int, hi))
        if len(lo) != len(hi):
            raise ValueError(f"Rect bounds differ in rank: lo has {len(lo)} dims, hi has {len(hi)}")
        _set_field(self, "lo", lo)
        _set_field(self, "hi", hi)
        _set_field(self, "_empty", any(map(le, hi, lo)))

    @staticmethod
    def made(lo: tuple[int, ...], hi: tuple[int, ...], empty: bool | None = None) -> Rect:
        """A rect of bounds the caller has as tuples of ints, of equal length, without
        `__init__`'s conversions; `empty`, where the caller knows whether it is. The planner and
        the rank programs make some 10⁶ rects a large plan."""
        rect = object.__new__(Rect)
        _set_field(rect, "lo", lo)
        _set_field(rect, "hi", hi)
        _set_field(rect, "_empty", any(map(le, hi, lo)) if empty is None else empty)
        return rect

    @classmethod
    def from_dims(cls, dims: Iterable[int]) -> Rect:
        """The whole box of a tensor with these dims."""
        hi = tuple(int(d) for d in dims)
        return cls((0,) * len(hi), hi)

    @classmethod
    def empty(cls, ndim: int) -> Rect:
        return cls((0,) * ndim, (0,) * ndim)

    def __repr__(self) -> str:
        return f"Rect({_format_array(self.lo)}, {_format_array(self.hi)})"

    @property
    def ndim(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple([h - lo if h > lo else 0 for lo, h in zip(self.lo, self.hi)])

    @property
    def volume(self) -> int:
        v = 1
        for lo, h in zip(self.lo, self.hi):
            if h <= lo:
                return 0
            v *= h - lo
        return v

    def is_empty(self) -> bool:
        return self._empty

    def _check_rank(self, other: Rect) -> None:
        if other.ndim != self.ndim:
            raise ValueError(
                f"rank mismatch: {self!r} has {self.ndim} dims, {other!r} has {other.ndim}"
            )

    def intersect(self, other: Rect) -> Rect:
        self._check_rank(other)
        lo = tuple(map(max, self.lo, other.lo))
        hi = tuple(map(min, self.hi, other.hi))
        if any(map(le, hi, lo)):
            return Rect.empty(self.ndim)
        return Rect.made(lo, hi, False)

    def overlaps(self, other: Rect) -> bool:
        return not self.intersect(other).is_empty()

    def union_bounds(self, other: Rect) -> Rect:
        """The smallest box holding both; an empty operand contributes nothing."""
        self._check_rank(other)
        if other.is_empty():
            return self
        if self.is_empty():
            return other
        return Rect(
            tuple(min(a, b) for a, b in zip(self.lo, other.lo)),
            tuple(max(a, b) for a, b in zip(self.hi, other.hi)),
        )

    @staticmethod
    def bounding(rects: Iterable[Rect]) -> Rect | None:
        """The smallest box holding every non-empty rect of `rects` (None if there is none):
        `union_bounds` over all of them, in one pass."""
        nonempty = [r for r in rects if not r._empty]
        if not nonempty:
            return None
        if len(nonempty) == 1:
            return nonempty[0]
        lo = tuple(map(min, *(r.lo for r in nonempty)))
        hi = tuple(map(max, *(r.hi for r in nonempty)))
        return Rect.made(lo, hi, False)

    def contains(self, other: Rect) -> bool:
        """True when every point of `other` lies in self (an empty rect is contained anywhere)."""
        self._check_rank(other)
        if other.is_empty():
            return True
        return all(a <= c and d <= b for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi))

    def contains_point(self, point: Sequence[int]) -> bool:
        return all(lo <= p < hi for lo, p, hi in zip(self.lo, point, self.hi))

    def translate(self, offset: Sequence[int]) -> Rect:
        if len(offset) != self.ndim:
            raise ValueError(
                f"offset {tuple(offset)} has {len(offset)} dims, {self!r} has {self.ndim}"
            )
        return Rect(
            tuple(a + o for a, o in zip(self.lo, offset)),
            tuple(b + o for b, o in zip(self.hi, offset)),
        )

    def relative_to(self, origin: Rect) -> Rect:
        """This rect in the coordinates of a buffer that holds `origin`."""
        return self.translate(tuple(-v for v in origin.lo))

    def difference(self, other: Rect) -> list[Rect]:
        """Disjoint boxes covering exactly the points of self that are not in `other`.

        Slabs are peeled off dimension by dimension, so at most 2·ndim boxes come back.
        """
        self._check_rank(other)
        if self.is_empty():
            return []
        cut = self.intersect(other)
        if cut.is_empty():
            return [self]
        pieces: list[Rect] = []
        lo, hi = list(self.lo), list(self.hi)
        for d in range(self.ndim):
            if lo[d] < cut.lo[d]:
                pieces.append(
                    Rect.made(tuple(lo), tuple(hi[:d] + [cut.lo[d]] + hi[d + 1 :]), False)
                )
            if cut.hi[d] < hi[d]:
                pieces.append(
                    Rect.made(tuple(lo[:d] + [cut.hi[d]] + lo[d + 1 :]), tuple(hi), False)
                )
            lo[d], hi[d] = cut.lo[d], cut.hi[d]
        return pieces

    def minus(self, cuts: Iterable[Rect]) -> list[Rect]:
        """Disjoint, non-empty boxes covering exactly the points of self in none of `cuts`."""
        remaining = [] if self.is_empty() else [self]
        for cut in cuts:
            if not self.overlap_volume(cut):
                continue  # nor any part of self: a reduction's 64 targets, most elsewhere
            remaining = [piece for part in remaining for piece in part.difference(cut)]
            if not remaining:
                break
        return remaining

    def covered_by(self, parts: Iterable[Rect]) -> bool:
        """Whether every point of self lies in one of `parts`."""
        parts = list(parts)
        # most often one part holds it all (a replicated parameter, a halo's own cell)
        return any(part.contains(self) for part in parts) or not self.minus(parts)

    def covered_by_disjoint(self, parts: Iterable[Rect]) -> bool:
        """`covered_by` for parts that do not overlap (the cells of a layout): the parts' shares
        of self add up to all of it, found without cutting self into pieces."""
        want = self.volume
        for part in parts:
            want -= self.overlap_volume(part)
            if want <= 0:
                break
        return want <= 0

    def overlap_volume(self, other: Rect) -> int:
        """The volume of self ∩ other, without making the rect."""
        self._check_rank(other)
        v = 1
        for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi):
            extent = (min(d, b)) - (max(c, a))
            if extent <= 0:
                return 0
            v *= extent
        return v

    def split(self, grid: Sequence[int]) -> list[Rect]:
        """A row-major grid of near-equal pieces, `grid[d]` parts along dim d (uneven allowed).

        Every piece is returned, empty ones included, so piece i always belongs to grid cell i.
        """
        if len(grid) != self.ndim:
            raise ValueError(f"grid {tuple(grid)} has {len(grid)} dims, {self!r} has {self.ndim}")
        per_dim = [split_bounds(lo, hi, parts) for lo, hi, parts in zip(self.lo, self.hi, grid)]
        return [
            Rect(tuple(b[0] for b in cell), tuple(b[1] for b in cell)) for cell in product(*per_dim)
        ]

    def split_dims(self, parts_by_dim: dict[int, int]) -> list[Rect]:
        """`split` with only the named dims cut, e.g. ``{0: 4}`` for four batch pieces."""
        grid = [parts_by_dim.get(d, 1) for d in range(self.ndim)]
        return self.split(grid)

    def to_slices(self) -> tuple[slice, ...]:
        """NumPy basic-indexing slices selecting this box from an array holding the whole tensor."""
        return tuple(slice(lo, max(lo, hi)) for lo, hi in zip(self.lo, self.hi))

    def to_json(self) -> dict[str, list[int]]:
        return {"lo": list(self.lo), "hi": list(self.hi)}

    @classmethod
    def from_json(cls, data: dict) -> Rect:
        return cls(tuple(data["lo"]), tuple(data["hi"]))
