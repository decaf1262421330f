"""What a task's messages put on each rank's links, computed dim by dim rather than message by
message, for the search (`transitions.py`).

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

`fetch_loads` and `combine_loads` return exactly what `link_loads` and the memory accounting
make of the block and the collectives `fetch` and `combine` return (`tests/test_grid_loads.py`
compares them), or None where their preconditions do not hold: a cell held by several ranks, a
rank touching one rect twice, rects that are not every combination of their intervals (for a
combine), too many intervals, or anything `fetch` or `combine` would reject (a read of a part
nobody holds). The caller then uses those functions.
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
    (`transfers.link_loads` of the block, as integers), and bytes held because of the block
    (received parts for a fetch, partial sums sent for a combine); `wire` is the bytes the
    transfers carry, counted per destination."""

    sent: np.ndarray
    received: np.ndarray
    rounds: np.ndarray
    held: np.ndarray
    wire: int

    @property
    def empty(self) -> bool:
        return not self.rounds.any()


@dataclass
class Collectives:
    """The collectives of `messages.combine`, in its order, as arrays: collective k runs over
    the ranks `groups[group[k]]` and rank `extra[k]` (-1: none), is a `reduce` (one holder) or a
    `reduce_scatter`, moves `total[k]` bytes of which one holder owns at most `largest[k]`;
    target t (in order) belongs to collective `which[t]`, spans (`lo[t]`, `hi[t]`), is held by
    `holders[t]` and has `nbytes[t]` bytes."""

    groups: list[np.ndarray]
    group: np.ndarray
    extra: np.ndarray
    reduce: np.ndarray
    total: np.ndarray
    largest: np.ndarray
    which: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    holders: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.group)

    def sizes(self) -> np.ndarray:
        """Participants of each collective."""
        counts = np.array([len(g) for g in self.groups], boxes.INDEX)
        return counts[self.group] + (self.extra >= 0)

    def participants(self, k: int) -> np.ndarray:
        """The ranks taking part in collective k, sorted."""
        members = self.groups[int(self.group[k])]
        extra = int(self.extra[k])
        return members if extra < 0 else np.sort(np.append(members, extra))

    @staticmethod
    def none(ndim: int) -> Collectives:
        empty = np.zeros(0, boxes.INDEX)
        lo, hi = boxes.empty(ndim)
        return Collectives(
            [], empty, empty, np.zeros(0, bool), empty, empty, empty, lo, hi, empty, empty
        )


_TREES: dict[int, np.ndarray] = {}
_WORDS: dict[int, np.ndarray] = {}


def _words(n: int) -> np.ndarray:
    """A fixed random 64-bit word per rank (set hashes: a set's is the sum of its ranks')."""
    found = _WORDS.get(n)
    if found is None:
        rng = np.random.default_rng(0x5EED)
        found = _WORDS[n] = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + 1
    return found


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
        #: per dim, overlaps of the cuts with sets of intervals (`_overlaps`)
        self.overlaps: dict[tuple[bytes, bytes, bytes], _Overlap] = {}
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


class _Overlap:
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


def _overlaps(geometry: Geometry, rects: RectSet, cache: dict | None) -> list[_Overlap]:
    cache = geometry.overlaps if cache is None else cache
    out = []
    for cuts, lo, hi in zip(geometry.cuts, rects.lo, rects.hi):
        key = (cuts.tobytes(), lo.tobytes(), hi.tobytes())
        found = cache.get(key)
        if found is None:
            found = cache[key] = _Overlap(cuts, lo, hi)
        out.append(found)
    return out


def _outer(vectors: list[np.ndarray]) -> np.ndarray:
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


def _per_cell(rects: RectSet, dims: list[_Overlap], values: np.ndarray, volume: bool) -> np.ndarray:
    """Per cell, Σ over rects u overlapping it of values[u] × (overlap volume or 1)."""
    if rects.full and len(values) and (values == values[0]).all():
        sums = [d.length_by_cut if volume else d.hits_by_cut for d in dims]
        return _outer(sums) * values[0]
    mats = [d.length if volume else d.hit for d in dims]
    return _contract(rects.tensor(values), mats)


def _per_rect(rects: RectSet, dims: list[_Overlap], cells: np.ndarray | None, volume: bool):
    """Per rect u, Σ over cells c overlapping it of cells[c] × (overlap volume or 1); `cells`
    None: every cell counts 1."""
    if cells is None:
        sums = [d.length_by_interval if volume else d.hits_by_interval for d in dims]
        return reduce(np.multiply, [s[i] for s, i in zip(sums, rects.index)])
    mats = [(d.length if volume else d.hit).T for d in dims]
    shape = tuple(m.shape[1] for m in mats)
    return _contract(cells.reshape(shape), mats)[rects.flat]


def _overlap(lo_a, hi_a, lo_b, hi_b) -> np.ndarray:
    """Volumes of the intersections of boxes a[i] and b[i]."""
    return boxes.volumes(np.maximum(lo_a, lo_b), np.minimum(hi_a, hi_b))


def _zero(n: int) -> Moved:
    zero = np.zeros(n, boxes.INDEX)
    return Moved(zero, zero, zero, zero, 0)


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
    dims = _overlaps(grid, rects, cache)
    for d, lo, hi in zip(dims, rects.lo, rects.hi):
        if not np.array_equal(d.length_by_interval, hi - lo):
            return None  # part of a rect lies outside every cell
    if not grid.all_held:
        touched = _per_cell(rects, dims, np.ones(rects.count, boxes.INDEX), volume=False)
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
    local = _overlap(cell_lo, cell_hi, rects.rect_lo[u], rects.rect_hi[u])
    mine = local > 0
    which, cells, u, local = which[mine], cells[mine], u[mine], local[mine]
    away = rects.volume[rect]
    if len(which):
        away = away - np.bincount(which, weights=local, minlength=len(rect)).astype(boxes.INDEX)
    if not away.any():
        return _zero(n)
    own = np.bincount(which, minlength=len(rect))  # cells of its rect the reader holds
    held_by_readers = np.bincount(rect, weights=own, minlength=rects.count).astype(boxes.INDEX)
    count = _per_rect(rects, dims, None, volume=False)  # cells overlapping each rect
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
    # a cell's holder sends each fresh rect's part once (to all its readers), ...
    part_bytes = _per_cell(rects, dims, (readers > 0).astype(boxes.INDEX), volume=True)
    part_rounds = _per_cell(rects, dims, full, volume=False)
    # ... except to itself: a part whose only fresh reader holds it is not sent
    if len(which):
        alone = readers[u] == 1
        part_bytes = part_bytes - np.bincount(
            cells[alone], weights=local[alone], minlength=grid.ncells
        ).astype(boxes.INDEX)
        part_rounds = part_rounds - np.bincount(
            cells, weights=full[u] - less[u], minlength=grid.ncells
        ).astype(boxes.INDEX)
    held = grid.owner >= 0
    sent = np.zeros(n)
    sent += np.bincount(grid.owner[held], weights=part_bytes[held] * itemsize, minlength=n)[:n]
    rounds += np.bincount(grid.owner[held], weights=part_rounds[held], minlength=n)[:n]
    received = received.astype(boxes.INDEX)
    wire = int(away.sum()) * itemsize
    return Moved(sent.astype(boxes.INDEX), received, rounds.astype(boxes.INDEX), received, wire)


def combine_loads(
    layout: Layout | Geometry,
    contributions: Accesses | RectSet,
    itemsize: int,
    nranks: int,
    cache: dict | None = None,
) -> tuple[Moved, Collectives] | None:
    """`link_loads` of `messages.combine`'s partial sums (and the bytes each sender holds for
    them) and its collectives, in its order, or None."""
    n = nranks
    grid = layout if isinstance(layout, Geometry) else Geometry(layout, n)
    rects = contributions if isinstance(contributions, RectSet) else RectSet(contributions)
    rect, ranks = rects.pair_rect, rects.pair_rank
    if not grid.single or not len(rect) or not rects.unique_pairs or not rects.full:
        return None
    if rects.size > LIMIT or ranks.max() >= n or grid.owner.max(initial=-1) >= n:
        return None
    dims = _overlaps(grid, rects, cache)
    contributors = rects.touchers
    entries = _outer([d.hits_by_cut for d in dims])  # rects overlapping each cell
    total = _per_cell(rects, dims, contributors, volume=False)
    group = entries > 0
    owner = grid.owner
    if not grid.all_held and np.any(group & (owner < 0)):
        return None
    # per dim and cut: do all intervals meeting the cut meet it in the same part?
    same, part_lo, part_hi = [], [], []
    big, small = np.iinfo(boxes.INDEX).max, np.iinfo(boxes.INDEX).min
    for d in dims:
        meets = d.hit.astype(bool)
        lo_max = np.where(meets, d.part_lo, small).max(axis=1)
        hi_max = np.where(meets, d.part_hi, small).max(axis=1)
        lo_min = np.where(meets, d.part_lo, big).min(axis=1)
        hi_min = np.where(meets, d.part_hi, big).min(axis=1)
        same.append((lo_max == lo_min) & (hi_max == hi_min))
        part_lo.append(lo_max)
        part_hi.append(hi_max)
    equal = reduce(np.logical_and.outer, same).reshape(-1)
    simple = equal & (entries == 1) & (total == 1)
    direct = group & (~equal | simple)
    gathered = group & equal & ~simple
    some_gathered = bool(gathered.any())
    # 1. direct cells: every contributor but the holder sends its part to the holder
    which, cells = grid.held_by(ranks)
    u = rect[which]
    cell_lo, cell_hi = grid.bounds(cells)
    local = _overlap(cell_lo, cell_hi, rects.rect_lo[u], rects.rect_hi[u])
    keep = (local > 0) & direct[cells]
    which, cells, local = which[keep], cells[keep], local[keep]
    flags = direct.astype(boxes.INDEX) if some_gathered else None
    out_bytes = _per_rect(rects, dims, flags, volume=True)[rect]
    out_count = _per_rect(rects, dims, flags, volume=False)[rect]
    in_bytes = _per_cell(rects, dims, contributors, volume=True)
    in_count = total
    if len(which):
        out_bytes = out_bytes - np.bincount(which, weights=local, minlength=len(rect)).astype(
            boxes.INDEX
        )
        out_count = out_count - np.bincount(which, minlength=len(rect))
        in_bytes = in_bytes - np.bincount(cells, weights=local, minlength=grid.ncells).astype(
            boxes.INDEX
        )
        in_count = in_count - np.bincount(cells, minlength=grid.ncells)
    sent, received, rounds = np.zeros(n), np.zeros(n), np.zeros(n)
    sent += np.bincount(ranks, weights=out_bytes * itemsize, minlength=n)
    rounds += np.bincount(ranks, weights=out_count, minlength=n)
    into = direct if grid.all_held else direct & (owner >= 0)
    received += np.bincount(owner[into], weights=in_bytes[into] * itemsize, minlength=n)[:n]
    rounds += np.bincount(owner[into], weights=in_count[into], minlength=n)[:n]
    # 2. gathered cells: every contributor's part is the same; among the contributors and the
    #    holder, two exchange one partial sum, more run a collective
    collectives = Collectives.none(len(grid.cuts))
    if some_gathered:
        gather = _Gathered(grid, rects, dims, gathered, part_lo, part_hi, itemsize, n)
        sent += gather.sent
        received += gather.received
        rounds += gather.rounds
        collectives = gather.collectives()
    sent = sent.astype(boxes.INDEX)
    moved = Moved(
        sent, received.astype(boxes.INDEX), rounds.astype(boxes.INDEX), sent, int(sent.sum())
    )
    return moved, collectives


class _Gathered:
    """The gathered cells of a combine: per cell, the ranks contributing to it (the union over
    the rects overlapping it) and its holder. Cells overlapped by one rect take that rect's
    contributors; others those of the set of rects overlapping them (`_by_signature`)."""

    def __init__(self, grid, rects, dims, gathered, part_lo, part_hi, itemsize, n) -> None:
        self.n, self.itemsize, self.ndim = n, itemsize, len(grid.cuts)
        self.sent, self.received, self.rounds = np.zeros(n), np.zeros(n), np.zeros(n)
        cells = np.flatnonzero(gathered)
        coords = np.unravel_index(cells, grid.shape)
        lo = np.stack([p[x] for p, x in zip(part_lo, coords)], 1)
        hi = np.stack([p[x] for p, x in zip(part_hi, coords)], 1)
        holders = grid.owner[cells]
        self.members: list[np.ndarray] = []  # distinct contributor sets, sorted
        self.member_ids: dict[bytes, int] = {}
        # per cell: the first rect (in combine's order) overlapping it, its contributor set,
        # whether the holder is in the set
        first = np.zeros(len(cells), boxes.INDEX)
        mid = np.zeros(len(cells), boxes.INDEX)
        inside = np.zeros(len(cells), bool)
        one = reduce(np.logical_and, [d.hits_by_cut[x] == 1 for d, x in zip(dims, coords)])
        if one.any():
            # the rect overlapping each such cell, from its one interval per dim
            k = [np.argmax(d.hit[x[one]], axis=1) for d, x in zip(dims, coords)]
            u = rects.rect_at[np.ravel_multi_index(k, rects.shape)]
            order = np.lexsort((rects.pair_rank, rects.pair_rect))
            by_rect = rects.pair_rank[order]
            ptr = np.zeros(rects.count + 1, boxes.INDEX)
            np.cumsum(rects.touchers, out=ptr[1:])
            span = max(n, int(by_rect.max(initial=0)) + 1)
            inside[one] = np.isin(u * span + holders[one], rects.pair_rect * span + rects.pair_rank)
            ids = np.zeros(rects.count, boxes.INDEX)
            for r in np.unique(u).tolist():
                ids[r] = self._member_id(by_rect[ptr[r] : ptr[r + 1]])
            first[one], mid[one] = u, ids[u]
        rest = np.flatnonzero(~one)
        if len(rest):
            self._by_signature(
                rects, dims, [x[rest] for x in coords], holders, rest, first, mid, inside
            )
        self._book(cells, first, mid, holders, inside, lo, hi)

    def _member_id(self, members: np.ndarray) -> int:
        key = members.tobytes()
        found = self.member_ids.get(key)
        if found is None:
            found = self.member_ids[key] = len(self.members)
            self.members.append(members)
        return found

    def _by_signature(self, rects, dims, coords, holders, rest, first, mid, inside) -> None:
        """Cells overlapped by several rects, grouped by which rects (per dim: which
        intervals) overlap them."""
        patterns, pattern_of = [], []
        for d, x in zip(dims, coords):
            unique, inverse = np.unique(d.hit, axis=0, return_inverse=True)
            patterns.append(unique.astype(bool))
            pattern_of.append(inverse.reshape(-1)[x])
        counts = tuple(len(p) for p in patterns)
        signature = np.ravel_multi_index(pattern_of, counts)
        groups, inverse = np.unique(signature, return_inverse=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(groups) + 1))
        rows = np.unravel_index(groups, counts)
        # each dim's pattern rows, read at every rect's interval
        at = [pattern[:, index] for pattern, index in zip(patterns, rects.index)]
        mark = np.zeros(self.n, bool)
        for g, sig_rows in enumerate(zip(*(r.tolist() for r in rows))):
            meets = at[0][sig_rows[0]]
            for found, row in zip(at[1:], sig_rows[1:]):
                meets = meets & found[row]
            mark[:] = False
            mark[rects.pair_rank[meets[rects.pair_rect]]] = True
            mine = rest[order[bounds[g] : bounds[g + 1]]]
            first[mine] = int(np.argmax(meets))
            mid[mine] = self._member_id(np.flatnonzero(mark))
            inside[mine] = mark[holders[mine]]

    def _book(self, cells, first, mid, holders, inside, lo, hi) -> None:
        """Two participants exchange a partial sum; more are kept for `collectives`."""
        n = self.n
        nbytes = boxes.volumes(lo, hi) * self.itemsize
        sizes = np.array([len(m) for m in self.members], boxes.INDEX)
        size = sizes[mid] + ~inside
        pair = size == 2
        if pair.any():
            # the one other participant: the other contributor, or the only one
            smallest = np.array([m[0] for m in self.members], boxes.INDEX)[mid[pair]]
            largest = np.array([m[-1] for m in self.members], boxes.INDEX)[mid[pair]]
            at = holders[pair]
            other = np.where(inside[pair], np.where(smallest == at, largest, smallest), smallest)
            self.sent += np.bincount(other, weights=nbytes[pair], minlength=n)
            self.received += np.bincount(at, weights=nbytes[pair], minlength=n)
            self.rounds += np.bincount(other, minlength=n) + np.bincount(at, minlength=n)
        big = size > 2
        extra = np.where(inside[big], -1, holders[big])
        self.columns = (
            first[big],
            cells[big],
            mid[big] * (n + 1) + extra + 1,
            holders[big],
            lo[big],
            hi[big],
        )

    def _same_sets(self, keys: np.ndarray) -> np.ndarray:
        """An id per key (contributor set, extra holder) naming its set of participants: keys
        whose sets hash alike (a sum of random words per rank) are compared exactly."""
        n = self.n
        mid, extra = np.divmod(keys, n + 1)
        words = _words(n)
        member_hash = np.array([words[m].sum() for m in self.members], np.uint64)
        sizes = np.array([len(m) for m in self.members], boxes.INDEX)
        hashed = member_hash[mid] + np.where(
            extra > 0, words[np.maximum(extra - 1, 0)], np.uint64(0)
        )
        size = sizes[mid] + (extra > 0)
        _, alike = np.unique(
            np.stack([hashed.view(np.int64), size], axis=1), axis=0, return_inverse=True
        )
        alike = alike.reshape(-1)
        out = np.zeros(len(keys), boxes.INDEX)
        canonical: dict[bytes, int] = {}
        for k in np.flatnonzero(np.bincount(alike)[alike] > 1).tolist() or []:
            members = self.members[mid[k]]
            if extra[k]:
                members = np.sort(np.append(members, extra[k] - 1))
            out[k] = canonical.setdefault(members.tobytes(), len(canonical))
        lone = np.bincount(alike)[alike] == 1
        out[lone] = len(canonical) + np.arange(int(lone.sum()))
        return out

    def collectives(self) -> Collectives:
        """Merged by participants, in order of their first cell as `combine` meets them."""
        if not len(self.columns[0]):
            return Collectives.none(self.ndim)
        n = self.n
        first, cells, key, holders, lo, hi = self.columns
        at = np.lexsort((cells, first))
        key, holders, lo, hi = key[at], holders[at], lo[at], hi[at]
        # a collective per distinct set of participants (a contributor set plus a holder
        # outside it may equal another contributor set)
        keys, inverse = np.unique(key, return_inverse=True)
        group = self._same_sets(keys)[inverse.reshape(-1)]
        which, leads = boxes.first_seen_ids(group[:, None])
        mid, extra = np.divmod(key[leads], n + 1)
        at = np.argsort(which, kind="stable")
        which, holders, lo, hi = which[at], holders[at], lo[at], hi[at]
        nbytes = boxes.volumes(lo, hi) * self.itemsize
        count = len(leads)
        total = np.bincount(which, weights=nbytes, minlength=count).astype(boxes.INDEX)
        # per collective and holder, the bytes it owns
        owned, inverse = np.unique(which * n + holders, return_inverse=True)
        share = np.bincount(inverse.reshape(-1), weights=nbytes).astype(boxes.INDEX)
        largest = np.zeros(count, boxes.INDEX)
        np.maximum.at(largest, owned // n, share)
        reduce_ = np.bincount(owned // n, minlength=count) == 1
        return Collectives(
            self.members, mid, extra - 1, reduce_, total, largest, which, lo, hi, holders, nbytes
        )
