"""Arrays of N-d boxes: the vectorised geometry that planning many ranks runs on.

n boxes of one rank are two int64 arrays `lo`, `hi` of shape (n, ndim), with the conventions of
`Rect` (lo inclusive, hi exclusive; a box with some hi <= lo is empty). Planning 1024 ranks meets
hundreds of thousands of boxes (pieces, halos, the parts of messages); holding them in arrays
turns per-box Python work into a few NumPy calls per task, and `Rect` objects are made only when
someone asks for them.

A *grid* here is the cell grid of a `Layout`: sorted cut points per dim, cells numbered row-major.
`grid_overlaps` is `Layout.cells` for many boxes at once, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from legion_nn.rect import Rect, split_bounds

INDEX = np.int64


def empty(ndim: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((0, ndim), INDEX), np.zeros((0, ndim), INDEX)


def from_rects(rects: Sequence[Rect], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    if not rects:
        return empty(ndim)
    return (
        np.array([r.lo for r in rects], INDEX).reshape(len(rects), ndim),
        np.array([r.hi for r in rects], INDEX).reshape(len(rects), ndim),
    )


#: the most boxes whose volumes and emptiness are found by one reduction along their rows;
#: beyond, column by column, several times faster over many short rows (on 64 boxes of 4 dims
#: the reduction takes 2-3 µs, the columns 5-8; on 20,000 the columns 80 µs, the reduction 400)
ROW_REDUCTION_AT_MOST = 256


def volumes(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elements of each box (0 for an empty one)."""
    if len(lo) <= ROW_REDUCTION_AT_MOST:
        return np.multiply.reduce(np.maximum(hi - lo, 0), axis=1, dtype=INDEX)
    out = np.ones(len(lo), INDEX)
    for d in range(lo.shape[1]):
        out *= np.maximum(hi[:, d] - lo[:, d], 0)
    return out


def nonempty(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    if len(lo) <= ROW_REDUCTION_AT_MOST:
        return np.logical_and.reduce(hi > lo, axis=1)
    out = np.ones(len(lo), bool)
    for d in range(lo.shape[1]):
        out &= hi[:, d] > lo[:, d]
    return out


def bounding_by_key(
    keys: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key among `keys` (ascending) that has a non-empty box, the bounding box of its
    non-empty boxes (`keys[i]`'s box is `lo[i]`, `hi[i]`): `Rect.bounding` over arrays."""
    full = nonempty(lo, hi)
    keys, lo, hi = keys[full], lo[full], hi[full]
    order = np.argsort(keys, kind="stable")
    keys, lo, hi = keys[order], lo[order], hi[order]
    if not len(keys):
        return keys, lo, hi
    starts = run_starts(keys[1:] != keys[:-1])
    return keys[starts], np.minimum.reduceat(lo, starts), np.maximum.reduceat(hi, starts)


def to_rect(lo: Sequence[int], hi: Sequence[int], empty: bool | None = None) -> Rect:
    """A Rect from one row of each array (ints, as `tolist` gives them): `Rect.made`;
    `empty`, where the caller knows whether it is.

    Materialising a plan of 1024 ranks makes about a million of these."""
    return Rect.made(tuple(lo), tuple(hi), empty)


def to_rects(lo: np.ndarray, hi: np.ndarray) -> list[Rect]:
    empty = (~nonempty(lo, hi)).tolist()
    made = Rect.made
    return [made(tuple(a), tuple(b), e) for a, b, e in zip(lo.tolist(), hi.tolist(), empty)]


def run_starts(changed: np.ndarray) -> np.ndarray:
    """The index of the first element of each run of a sorted or grouped array, from `changed`:
    whether each element but the first differs from the one before it (`a[1:] != a[:-1]`)."""
    first = np.empty(len(changed) + 1, bool)
    first[0] = True
    first[1:] = changed
    return np.flatnonzero(first)


def run_ends(starts: np.ndarray, n: int) -> np.ndarray:
    """The index past the last element of each run of `run_starts` over `n` elements."""
    ends = np.empty(len(starts), INDEX)
    ends[:-1] = starts[1:]
    ends[-1:] = n
    return ends


def places_in_runs(starts: np.ndarray, n: int) -> np.ndarray:
    """Each of `n` elements' place within its run of `run_starts`: 0 for a run's first."""
    return np.arange(n, dtype=INDEX) - np.repeat(starts, run_ends(starts, n) - starts)


#: the most rows `first_seen_ids` numbers through a dict of their bytes, 4-5x faster than the
#: sort of their keys on a hundred rows (12 against 50 µs) and as fast on a thousand
FIRST_SEEN_BY_DICT_AT_MOST = 512


def _first_seen_by_dict(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`first_seen_ids` of a few rows: each row's bytes looked up in a dict of those seen."""
    n, k = rows.shape
    if k == 0:
        return np.zeros(n, INDEX), np.zeros(1, INDEX)
    rows = np.ascontiguousarray(rows, INDEX)
    keys = rows.view(np.dtype((np.void, rows.itemsize * k))).ravel().tolist()
    seen: dict[bytes, int] = {}
    ids = np.asarray([seen.setdefault(key, len(seen)) for key in keys], INDEX)
    # numbered as first met, so the most id so far grows exactly at each id's first row
    most = np.maximum.accumulate(ids)
    return ids, run_starts(most[1:] != most[:-1])


def first_seen_ids(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(id of each row, index of each id's first row), ids numbered in order of first appearance.

    `rows` is (n, k) int64; equal rows get equal ids."""
    if len(rows) == 0:
        return np.zeros(0, INDEX), np.zeros(0, INDEX)
    if len(rows) <= FIRST_SEEN_BY_DICT_AT_MOST:
        return _first_seen_by_dict(rows)
    # One int64 key per row, column by column in mixed radix; when the next column would
    # overflow it, the key is first renumbered densely (ids < n). Sorting int64 keys is several
    # times faster than np.unique(axis=0)'s sort of the rows as byte strings.
    # `bound` bounds the keys from above (all < bound), which saves a pass over them per column;
    # a constant column (most, in the rects of a few pieces) leaves the keys as they are.
    key = np.zeros(len(rows), INDEX)
    bound = 1
    for column in rows.T:
        low = int(column.min())
        span = int(column.max()) - low + 1
        if span == 1:
            continue
        if bound - 1 >= (1 << 62) // span:
            unique, key = np.unique(key, return_inverse=True)
            key, bound = key.reshape(-1).astype(INDEX), len(unique)
            if len(rows) >= (1 << 62) // span:
                key = np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)
                break
        key = key * span + (column - low)
        bound *= span
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    renumber = np.empty(len(first), INDEX)
    renumber[order] = np.arange(len(first), dtype=INDEX)
    return renumber[inverse.reshape(-1)], first[order]


def grid_cells(
    rect: Rect, grid: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
    """The non-empty cells of the row-major `grid` over `rect` (uneven splits as
    `split_bounds`): (ranks, lo, hi, bounds, coords), cell i on rank i, where `bounds[d]` are
    dim d's (start, stop) pairs and `coords` the kept cells' grid coordinates (ndim, cells).
    Found once per rect and grid (a search asks again for the tasks of one shape on one grid:
    148 of vgg19's 371 on 1024 ranks), so the arrays are read-only."""
    return _grid_cells(rect.lo, rect.hi, tuple(grid))


@lru_cache(maxsize=4096)
def _grid_cells(
    rect_lo: tuple[int, ...], rect_hi: tuple[int, ...], grid: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
    bounds = [np.array(split_bounds(a, b, g), INDEX) for a, b, g in zip(rect_lo, rect_hi, grid)]
    coords = np.indices(grid, dtype=INDEX).reshape(len(grid), -1)
    lo = np.stack([bounds[d][coords[d], 0] for d in range(len(grid))], axis=1)
    hi = np.stack([bounds[d][coords[d], 1] for d in range(len(grid))], axis=1)
    keep = nonempty(lo, hi)
    found = (np.flatnonzero(keep).astype(INDEX), lo[keep], hi[keep], bounds, coords[:, keep])
    for array in (*found[:3], *bounds, found[4]):
        array.flags.writeable = False
    return found


def grid_shape(cuts: Sequence[np.ndarray]) -> tuple[int, ...]:
    return tuple(max(len(c) - 1, 0) for c in cuts)


def grid_strides(cuts: Sequence[np.ndarray]) -> np.ndarray:
    """Row-major strides of the cell grid (the last dim varies fastest)."""
    shape = grid_shape(cuts)
    strides = np.ones(len(shape), INDEX)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


#: the most bytes of `grid_overlaps`' answers kept, by the bytes of their arrays (forgotten all
#: at once past it: a model plan's all-to-all on 1024 ranks overlaps in a million pairs)
OVERLAPS_KEPT_BYTES = 64 << 20
_overlaps: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_overlaps_bytes = [0]


def grid_overlaps(
    cuts: Sequence[np.ndarray], lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (box, cell) pair that overlaps, with the overlap: (box, cell, part_lo, part_hi).

    Pairs come box by box, and for each box in row-major cell order, as `Layout.cells` yields them.
    Parts of a box outside the grid belong to no cell (the caller sees a shortfall in volume).

    Found once per cuts and boxes (read-only arrays, up to `OVERLAPS_KEPT_BYTES` kept): a plan
    asks again for the tensors of one shape on one grid (DenseNet-121's data plan on 64 ranks:
    175 distinct of 4,395)."""
    lo = np.asarray(lo, INDEX)
    hi = np.asarray(hi, INDEX)
    key = (lo.shape, lo.tobytes(), hi.tobytes(), *(np.asarray(c, INDEX).tobytes() for c in cuts))
    found = _overlaps.get(key)
    if found is None:
        found = _grid_overlaps(cuts, lo, hi)
        size = sum(array.nbytes for array in found)
        if _overlaps_bytes[0] + size > OVERLAPS_KEPT_BYTES:
            _overlaps.clear()
            _overlaps_bytes[0] = 0
        _overlaps[key] = found
        _overlaps_bytes[0] += size
        for array in found:
            array.flags.writeable = False
    return found


def _grid_overlaps(
    cuts: Sequence[np.ndarray], lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n, ndim = lo.shape
    if n == 0 or any(len(c) < 2 for c in cuts):
        return np.zeros(0, INDEX), np.zeros(0, INDEX), *empty(ndim)
    first, count = [], []
    for d, dim_cuts in enumerate(cuts):
        f = np.maximum(np.searchsorted(dim_cuts, lo[:, d], side="right") - 1, 0)
        last = np.minimum(np.searchsorted(dim_cuts, hi[:, d], side="left"), len(dim_cuts) - 1)
        first.append(f)
        count.append(np.maximum(last - f, 0))
    per_box = nonempty(lo, hi).astype(INDEX)
    for k in count:
        per_box *= k
    box = np.repeat(np.arange(n, dtype=INDEX), per_box)
    strides = grid_strides(cuts)
    start = np.zeros(n, INDEX)
    part_lo = np.empty((len(box), ndim), INDEX)
    part_hi = np.empty((len(box), ndim), INDEX)
    local = None
    for d in range(ndim - 1, -1, -1):
        if count[d].max(initial=0) <= 1:
            # one cell along d for every box: per-box arithmetic, gathered once
            start += first[d] * strides[d]
            part_lo[:, d] = np.maximum(cuts[d][first[d]], lo[:, d])[box]
            upper = cuts[d][np.minimum(first[d] + 1, len(cuts[d]) - 1)]
            part_hi[:, d] = np.minimum(upper, hi[:, d])[box]
            continue
        if local is None:
            local = np.arange(len(box), dtype=INDEX) - np.repeat(
                np.cumsum(per_box) - per_box, per_box
            )
            cell = np.zeros(len(box), INDEX)
        k = count[d][box]
        index = first[d][box] + local % k
        local //= k
        cell += index * strides[d]
        part_lo[:, d] = np.maximum(cuts[d][index], lo[box, d])
        part_hi[:, d] = np.minimum(cuts[d][index + 1], hi[box, d])
    cell = start[box] + (cell if local is not None else 0)
    return box, cell, part_lo, part_hi


def csr(groups: np.ndarray, values: np.ndarray, ngroups: int) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, values sorted by group, stable): a ragged list of values per group."""
    order = np.argsort(groups, kind="stable")
    ptr = np.zeros(ngroups + 1, INDEX)
    np.cumsum(np.bincount(groups, minlength=ngroups), out=ptr[1:])
    return ptr, values[order]


def gather_ragged(
    ptr: np.ndarray, values: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The ragged array of rows `rows` of the ragged array (`ptr`, `values`)."""
    counts = ptr[rows + 1] - ptr[rows]
    out_ptr = np.zeros(len(rows) + 1, INDEX)
    np.cumsum(counts, out=out_ptr[1:])
    index = np.repeat(ptr[rows] - out_ptr[:-1], counts) + np.arange(out_ptr[-1], dtype=INDEX)
    return out_ptr, values[index]
