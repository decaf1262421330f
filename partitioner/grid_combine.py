"""What a task's partial sums put on each rank's links, and the collectives that add them up,
computed dim by dim (`grid_loads.py` says how) for the search (`task_prices.py`).

`combine_loads` returns exactly what `link_loads` and the memory accounting make of the block and
the collectives `messages.combine` returns (`tests/partitioner/test_grid_loads.py` compares them), or None
where its preconditions do not hold: a cell held by several ranks, a rank touching one rect
twice, rects that are not every combination of their intervals, too many intervals, or anything
`combine` would reject. The caller then uses `combine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np

from partitioner import boxes
from partitioner.grid_loads import (
    LIMIT,
    Geometry,
    Moved,
    RectSet,
    dim_overlaps,
    flat_outer,
    intersection_volumes,
    per_cell,
    per_rect,
)
from partitioner.layout import Layout
from partitioner.messages import Accesses


@dataclass
class Collectives:
    """The collectives of `messages.combine`, in its order, as arrays: collective k runs over
    the ranks `groups[group[k]]`, is a `reduce` (one holder) or a `reduce_scatter` among its
    `contributors[k]` first (`Reduction.core_places`: the others are extras), moves
    `total[k]` bytes of which one of those ends with at most `largest[k]`, and whose partners
    hand its extras `handed_total[k]` bytes, the most one partner `handed_most[k]`; target t
    (in order) belongs to collective `which[t]`, spans (`lo[t]`, `hi[t]`), is held by
    `holders[t]` and has `nbytes[t]` bytes."""

    groups: list[np.ndarray]
    group: np.ndarray
    contributors: np.ndarray
    reduce: np.ndarray
    total: np.ndarray
    largest: np.ndarray
    handed_most: np.ndarray
    handed_total: np.ndarray
    which: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    holders: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.group)

    def participants(self, k: int) -> np.ndarray:
        """The ranks taking part in collective k, sorted."""
        return self.groups[int(self.group[k])]

    @staticmethod
    def none(ndim: int) -> Collectives:
        empty = np.zeros(0, boxes.INDEX)
        lo, hi = boxes.empty(ndim)
        return Collectives(
            [], empty, empty, np.zeros(0, bool), empty, empty, empty, empty, empty, lo, hi,
            empty, empty,
        )  # fmt: skip


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
    dims = dim_overlaps(grid, rects, cache)
    contributors = rects.touchers
    entries = flat_outer([d.hits_by_cut for d in dims])  # rects overlapping each cell
    total = per_cell(rects, dims, contributors, volume=False)
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
    local = intersection_volumes(cell_lo, cell_hi, rects.rect_lo[u], rects.rect_hi[u])
    keep = (local > 0) & direct[cells]
    which, cells, local = which[keep], cells[keep], local[keep]
    flags = direct.astype(boxes.INDEX) if some_gathered else None
    out_bytes = per_rect(rects, dims, flags, volume=True)[rect]
    out_count = per_rect(rects, dims, flags, volume=False)[rect]
    in_bytes = per_cell(rects, dims, contributors, volume=True)
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
    sent, received = sent.astype(boxes.INDEX), received.astype(boxes.INDEX)
    moved = Moved(sent, received, rounds.astype(boxes.INDEX), sent, received, int(sent.sum()))
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
        self.columns = (first[big], cells[big], mid[big], holders[big], lo[big], hi[big])

    def collectives(self) -> Collectives:
        """One per contributor set, in order of its first cell as `combine` meets them, its
        participants the contributors and the holders among them or not."""
        if not len(self.columns[0]):
            return Collectives.none(self.ndim)
        first, cells, mid, holders, lo, hi = self.columns
        at = np.lexsort((cells, first))
        mid, holders, lo, hi = mid[at], holders[at], lo[at], hi[at]
        which, leads = boxes.first_seen_ids(mid[:, None])
        at = np.argsort(which, kind="stable")
        which, holders, lo, hi = which[at], holders[at], lo[at], hi[at]
        nbytes = boxes.volumes(lo, hi) * self.itemsize
        count = len(leads)
        total = np.bincount(which, weights=nbytes, minlength=count).astype(boxes.INDEX)
        bounds = np.searchsorted(which, np.arange(count + 1))
        groups, group = [], np.zeros(count, boxes.INDEX)
        named: dict[bytes, int] = {}
        contributors = np.zeros(count, boxes.INDEX)
        reduce_ = np.zeros(count, bool)
        largest, handed_most, handed_total = (np.zeros(count, boxes.INDEX) for _ in range(3))
        for k, m in enumerate(mid[leads].tolist()):
            members = self.members[m]
            mine = slice(bounds[k], bounds[k + 1])
            owners, share = np.unique(holders[mine], return_inverse=True)
            share = np.bincount(share.reshape(-1), weights=nbytes[mine]).astype(boxes.INDEX)
            outside = ~np.isin(owners, members)
            participants = np.union1d(members, owners[outside]) if outside.any() else members
            group[k] = named.setdefault(participants.tobytes(), len(groups))
            if group[k] == len(groups):
                groups.append(participants)
            reduce_[k] = len(owners) == 1
            if reduce_[k]:
                contributors[k] = len(participants)
                continue
            contributors[k] = len(members)
            # each extra's sums handed it by the partner `Reduction.core_places` gives it
            ends = np.zeros(len(members), boxes.INDEX)
            np.add.at(ends, np.searchsorted(members, owners[~outside]), share[~outside])
            partner = np.arange(int(outside.sum())) % len(members)
            np.add.at(ends, partner, share[outside])
            largest[k] = ends.max()
            if outside.any():
                handed = np.bincount(partner, weights=share[outside]).astype(boxes.INDEX)
                handed_most[k] = handed.max()
                handed_total[k] = share[outside].sum()
        return Collectives(
            groups, group, contributors, reduce_, total, largest, handed_most, handed_total,
            which, lo, hi, holders, nbytes,
        )  # fmt: skip
