"""What a task's messages put on each rank's links, computed dim by dim rather than message by
message, for the search (`task_prices.py`).

`messages.fetch` and `messages.combine` list every message: the part of every read rect in every
cell of the layout it reads. Between two different grids that is a product: 1024 pieces split
over rows and columns reading a tensor split over 512 channels make 1024 × 512 parts. What the
cost model needs of them is much smaller: per rank, the bytes sent and received and the message
rounds (`transfers.link_loads`), the bytes on the wire, the bytes of received parts and partial
sums a rank holds, and the collectives. These follow from per-dim information, because the
rects are boxes:

- the distinct rects a task's pieces touch take, in each dim, one of a few intervals (a halo of
  rows, all channels), and a rect's overlap with a cell of the layout is the product of its
  intervals' overlaps with the cell's cut in each dim. Sums over (rect, cell) pairs of overlap
  volumes, or of counts, are contractions of a small tensor indexed by intervals (which rects
  there are, how many readers each has) with one overlap matrix per dim (cuts × intervals);
  when every combination of intervals is a rect and the weights are equal, they are outer
  products of the matrices' row or column sums;
- the only coupling between a reader and a holder is that a rank may be both (it sends itself
  nothing): a correction per reader and cell it holds, at most a few per rank.

Here are those sums (`per_cell`, `per_rect`) and the fetch; the combine, with its collectives, is
`grid_combine.py`. `fetch_loads` returns exactly what `link_loads` and the memory accounting make
of the block `fetch` returns (`tests/partitioner/test_grid_loads.py` compares them), or None where its
preconditions do not hold: a cell held by several ranks, a rank reading two rects, too many
intervals, or a read `fetch` would reject (of a part nobody holds). The caller then uses `fetch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np

from partitioner import boxes
from partitioner.layout import Layout
from partitioner.messages import Accesses

#: the interval tensor of a task's rects may have at most this many entries
LIMIT = 1 << 16


@dataclass
class Moved:
    """Per rank (int64 arrays over ranks 0..n-1): bytes sent, bytes received, message rounds
    (`transfers.link_loads` of the block, as integers), bytes held because of the block
    (received parts for a fetch, partial sums sent for a combine) and bytes its messages stage
    (`accounting.staged_bytes`); `wire` is the bytes the transfers carry, counted per
    destination."""

    sent: np.ndarray
    received: np.ndarray
    rounds: np.ndarray
    held: np.ndarray
    staged: np.ndarray
    wire: int

    @property
    def empty(self) -> bool:
        return not self.rounds.any()


_TREES: dict[int, np.ndarray] = {}


def trees(upto: int) -> np.ndarray:
    """Rounds of a broadcast to 0..upto destinations, as `transfers.link_loads` counts them."""
    found = _TREES.get(upto)
    if found is None:
        found = _TREES[upto] = np.ceil(np.log2(np.arange(upto + 1) + 1.0)).astype(boxes.INDEX)
    return found


class Geometry:
    """A layout as the functions here read it: its cuts, each cell's holder (-1: nobody) and
    each rank's cells. `single` is false where some cell has several holders."""

    def __init__(self, layout: Layout, nranks: int) -> None:
        self.cuts = layout.cut_arrays
        self.shape = boxes.grid_shape(self.cuts)
        self.ncells = layout.ncells
        self.single = self.ncells > 0 and int(layout.holder_count.max(initial=0)) <= 1
        #: per dim, overlaps of the cuts with sets of intervals (`dim_overlaps`)
        self.overlaps: dict[tuple[bytes, bytes, bytes], DimOverlap] = {}
        if not self.single:
            return
        owner = np.full(self.ncells, -1, boxes.INDEX)
        held = np.flatnonzero(layout.holder_count)
        owner[held] = layout.holder_ranks[layout.holder_ptr[held]]
        self.owner = owner
        self.all_held = len(held) == self.ncells
        self.span = max(nranks, int(owner.max(initial=-1)) + 1)
        per_rank = np.bincount(owner[held], minlength=self.span)
        self.one_each = int(per_rank.max(initial=0)) <= 1
        if self.one_each:
            self.cell_of = np.full(self.span, -1, boxes.INDEX)
            self.cell_of[owner[held]] = held
        else:
            self.rank_ptr, self.rank_cells = boxes.csr(owner[held], held, self.span)
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None

    def held_by(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into `ranks`, cell) for every cell each of `ranks` holds."""
        if self.one_each:
            cells = self.cell_of[ranks]
            which = np.flatnonzero(cells >= 0)
            return which, cells[which]
        ptr, cells = boxes.gather_ragged(self.rank_ptr, self.rank_cells, ranks)
        return np.repeat(np.arange(len(ranks), dtype=boxes.INDEX), np.diff(ptr)), cells

    def bounds(self, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._bounds is None:
            lo = np.stack(np.meshgrid(*[c[:-1] for c in self.cuts], indexing="ij"), -1)
            hi = np.stack(np.meshgrid(*[c[1:] for c in self.cuts], indexing="ij"), -1)
            ndim = len(self.cuts)
            self._bounds = lo.reshape(-1, ndim), hi.reshape(-1, ndim)
        return self._bounds[0][cells], self._bounds[1][cells]


class RectSet:
    """The rects of an `Accesses` and who touches them, with each rect's interval per dim:
    `index[e][u]` among the distinct intervals (`lo[e]`, `hi[e]`) of dim e. `full` is whether
    every combination of intervals is a rect."""

    def __init__(self, accesses: Accesses) -> None:
        self.rect_lo, self.rect_hi = accesses.rect_lo, accesses.rect_hi
        self.count = len(accesses)
        counts = np.diff(accesses.ptr)
        self.pair_rect = np.repeat(np.arange(self.count, dtype=boxes.INDEX), counts)
        self.pair_rank = accesses.ranks
        self.touchers = counts
        self.volume = boxes.volumes(self.rect_lo, self.rect_hi)
        span = int(self.pair_rank.max(initial=0)) + 1
        keys = self.pair_rect * span + self.pair_rank
        self.unique_pairs = len(np.unique(keys)) == len(keys)
        self.index, self.lo, self.hi = [], [], []
        for e in range(self.rect_lo.shape[1]):
            lo, hi = self.rect_lo[:, e], self.rect_hi[:, e]
            base = int(lo.min(initial=0))
            width = int(hi.max(initial=0)) - base + 1
            unique, inverse = np.unique((lo - base) * width + (hi - base), return_inverse=True)
            self.index.append(inverse.reshape(-1))
            self.lo.append(unique // width + base)
            self.hi.append(unique % width + base)
        self.shape = tuple(len(i) for i in self.lo)
        self.size = int(np.prod(self.shape, dtype=np.float64)) if self.shape else 1
        self.full = self.size == self.count
        self.flat = None
        if self.size <= LIMIT and self.count:
            self.flat = np.ravel_multi_index(self.index, self.shape)
            self.rect_at = np.full(self.size, -1, boxes.INDEX)
            self.rect_at[self.flat] = np.arange(self.count, dtype=boxes.INDEX)

    def tensor(self, values: np.ndarray) -> np.ndarray:
        """An interval tensor holding `values[u]` at rect u's entry (0 where no rect is)."""
        out = np.zeros(self.size, boxes.INDEX)
        out[self.flat] = values
        return out.reshape(self.shape)


class DimOverlap:
    """One dim: the overlap of each cut (row) with each interval (column), its length and
    whether it is non-empty, with their row and column sums."""

    def __init__(self, cuts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        part_lo = np.maximum(lo[None, :], cuts[:-1, None])
        part_hi = np.minimum(hi[None, :], cuts[1:, None])
        self.length = np.maximum(part_hi - part_lo, 0)
        self.hit = (self.length > 0).astype(boxes.INDEX)
        self.part_lo, self.part_hi = part_lo, part_hi
        self.length_by_cut = self.length.sum(axis=1)
        self.length_by_interval = self.length.sum(axis=0)
        self.hits_by_cut = self.hit.sum(axis=1)
        self.hits_by_interval = self.hit.sum(axis=0)


def dim_overlaps(geometry: Geometry, rects: RectSet, cache: dict | None) -> list[DimOverlap]:
    cache = geometry.overlaps if cache is None else cache
    out = []
    for cuts, lo, hi in zip(geometry.cuts, rects.lo, rects.hi):
        key = (cuts.tobytes(), lo.tobytes(), hi.tobytes())
        found = cache.get(key)
        if found is None:
            found = cache[key] = DimOverlap(cuts, lo, hi)
        out.append(found)
    return out


def flat_outer(vectors: list[np.ndarray]) -> np.ndarray:
    """The flat (row-major) outer product of one vector per dim."""
    return reduce(np.multiply.outer, vectors).reshape(-1)


def _contract(tensor: np.ndarray, matrices: list[np.ndarray]) -> np.ndarray:
    """Σ over every axis e of `tensor` with `matrices[e]` (out × in): the mode products, the
    shrinking ones first so the intermediates stay small; flat, row-major."""
    order = sorted(range(tensor.ndim), key=lambda e: matrices[e].shape[0] / matrices[e].shape[1])
    for e in order:
        m = matrices[e]
        if m.shape == (1, 1):
            tensor = tensor * m[0, 0]
            continue
        front = int(np.prod(tensor.shape[:e], dtype=np.int64))
        moved = np.matmul(m, tensor.reshape(front, tensor.shape[e], -1))
        tensor = moved.reshape(tensor.shape[:e] + (m.shape[0],) + tensor.shape[e + 1 :])
    return tensor.reshape(-1)


def per_cell(
    rects: RectSet, dims: list[DimOverlap], values: np.ndarray, volume: bool
) -> np.ndarray:
    """Per cell, Σ over rects u overlapping it of values[u] × (overlap volume or 1)."""
    if rects.full and len(values) and (values == values[0]).all():
        sums = [d.length_by_cut if volume else d.hits_by_cut for d in dims]
        return flat_outer(sums) * values[0]
    mats = [d.length if volume else d.hit for d in dims]
    return _contract(rects.tensor(values), mats)


def per_rect(rects: RectSet, dims: list[DimOverlap], cells: np.ndarray | None, volume: bool):
    """Per rect u, Σ over cells c overlapping it of cells[c] × (overlap volume or 1); `cells`
    None: every cell counts 1."""
    if cells is None:
        sums = [d.length_by_interval if volume else d.hits_by_interval for d in dims]
        return reduce(np.multiply, [s[i] for s, i in zip(sums, rects.index)])
    mats = [(d.length if volume else d.hit).T for d in dims]
    shape = tuple(m.shape[1] for m in mats)
    return _contract(cells.reshape(shape), mats)[rects.flat]


def intersection_volumes(lo_a, hi_a, lo_b, hi_b) -> np.ndarray:
    """Volumes of the intersections of boxes a[i] and b[i]."""
    return boxes.volumes(np.maximum(lo_a, lo_b), np.minimum(hi_a, hi_b))


def _zero(n: int) -> Moved:
    zero = np.zeros(n, boxes.INDEX)
    return Moved(zero, zero, zero, zero, zero, 0)


def fetch_loads(
    layout: Layout | Geometry,
    reads: Accesses | RectSet,
    fresh: np.ndarray | None,
    itemsize: int,
    nranks: int,
    cache: dict | None = None,
) -> Moved | None:
    """`link_loads` (and the received bytes per rank) of `messages.fetch`'s block, or None;
    `fresh` None: every read is fresh. `cache` keeps per-dim overlaps across calls."""
    n = nranks
    grid = layout if isinstance(layout, Geometry) else Geometry(layout, n)
    rects = reads if isinstance(reads, RectSet) else RectSet(reads)
    rect, ranks, readers = rects.pair_rect, rects.pair_rank, rects.touchers
    if not rects.count:
        return _zero(n)
    if not grid.single or rects.flat is None or ranks.max() >= n:
        return None
    dims = dim_overlaps(grid, rects, cache)
    for d, lo, hi in zip(dims, rects.lo, rects.hi):
        if not np.array_equal(d.length_by_interval, hi - lo):
            return None  # part of a rect lies outside every cell
    if not grid.all_held:
        touched = per_cell(rects, dims, np.ones(rects.count, boxes.INDEX), volume=False)
        if np.any((touched > 0) & (grid.owner < 0)):
            return None
    if fresh is not None:
        if not fresh.any():
            return _zero(n)
        rect, ranks = rect[fresh], ranks[fresh]
        readers = np.bincount(rect, minlength=rects.count)
    if len(np.unique(ranks)) != len(ranks):
        return None  # a rank reading two rects may get equal parts of them (held once)
    # the cells each fresh reader holds, and what of its rect they hold
    which, cells = grid.held_by(ranks)
    u = rect[which]
    cell_lo, cell_hi = grid.bounds(cells)
    local = intersection_volumes(cell_lo, cell_hi, rects.rect_lo[u], rects.rect_hi[u])
    mine = local > 0
    which, cells, u, local = which[mine], cells[mine], u[mine], local[mine]
    away = rects.volume[rect]
    if len(which):
        away = away - np.bincount(which, weights=local, minlength=len(rect)).astype(boxes.INDEX)
    if not away.any():
        return _zero(n)
    own = np.bincount(which, minlength=len(rect))  # cells of its rect the reader holds
    held_by_readers = np.bincount(rect, weights=own, minlength=rects.count).astype(boxes.INDEX)
    count = per_rect(rects, dims, None, volume=False)  # cells overlapping each rect
    tree = trees(int(readers.max(initial=0)))
    full, less = tree[readers], tree[np.maximum(readers - 1, 0)]
    # a destination pays a round per cell of its rect it does not hold: ⌈log2(k+1)⌉ for the
    # k fresh readers of the rect that do not hold that cell
    rounds_in = (count[rect] - held_by_readers[rect]) * full[rect] + (
        held_by_readers[rect] - own
    ) * less[rect]
    received = np.zeros(n)
    received += np.bincount(ranks, weights=away * itemsize, minlength=n)
    rounds = np.zeros(n)
    rounds += np.bincount(ranks, weights=rounds_in, minlength=n)
    # a cell's holder sends each fresh rect's part once (to all its readers), and stages it
    # once per reader, ...
    part_bytes = per_cell(rects, dims, (readers > 0).astype(boxes.INDEX), volume=True)
    part_rounds = per_cell(rects, dims, full, volume=False)
    # ... except to itself: a part whose only fresh reader holds it is not sent
    if len(which):
        alone = readers[u] == 1
        part_bytes = part_bytes - np.bincount(
            cells[alone], weights=local[alone], minlength=grid.ncells
        ).astype(boxes.INDEX)
        part_rounds = part_rounds - np.bincount(
            cells, weights=full[u] - less[u], minlength=grid.ncells
        ).astype(boxes.INDEX)
    if readers.max(initial=0) > 1:  # a part staged once per reader that does not hold it
        each_bytes = per_cell(rects, dims, readers, volume=True)
        if len(which):
            each_bytes = each_bytes - np.bincount(
                cells, weights=local, minlength=grid.ncells
            ).astype(boxes.INDEX)
    else:  # one fresh reader a rect: each part staged as it is sent
        each_bytes = part_bytes
    held = grid.owner >= 0
    sent = np.zeros(n)
    sent += np.bincount(grid.owner[held], weights=part_bytes[held] * itemsize, minlength=n)[:n]
    staged = np.bincount(grid.owner[held], weights=each_bytes[held] * itemsize, minlength=n)[:n]
    rounds += np.bincount(grid.owner[held], weights=part_rounds[held], minlength=n)[:n]
    received = received.astype(boxes.INDEX)
    wire = int(away.sum()) * itemsize
    return Moved(
        sent.astype(boxes.INDEX),
        received,
        rounds.astype(boxes.INDEX),
        received,
        staged.astype(boxes.INDEX),
        wire,
    )
