"""The messages of one partitioned task, computed over arrays of pieces (rules in `plan.py`).

`fetch` brings every rect the pieces read to their ranks: the distinct read rects are cut by the
cells of the tensor's layout, and each part goes from one holder of its cell to the readers that
hold neither the cell nor an earlier copy of the rect (`Copies`). `combine` adds up what the pieces
reduce: per cell of the target's layout, either one collective among every contributor and holder
(merged across cells with the same participants, or of one holder and the same contributors) or
partial sums sent to the holders.

Both work on all the pieces of a task at once; Python loops run only over what is rare at scale
(cells held by several ranks that receive partial sums, and cells whose contributors form a
collective, whose participant lists are cached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from legion_nn.rect import Rect
from partitioner import boxes
from partitioner.layout import Layout
from partitioner.transfers import TransferBlock

Fail = Callable[[str], Exception]


class CollectiveSum(NamedTuple):
    """A collective `combine` found: its participants, its targets (rect, holders) and, where
    some participants only own targets, the `contributors`, whose partial sums it adds."""

    participants: tuple[int, ...]
    targets: list[tuple[Rect, tuple[int, ...]]]
    contributors: tuple[int, ...]


class Accesses:
    """The rects one task's pieces touch in one tensor with one kind of access, grouped by rect.

    `rect_lo`/`rect_hi` are the distinct rects in order of first appearance (`first_key`: the
    position of that appearance among the task's (piece, requirement) pairs); the ranks touching
    rect u are `ranks[ptr[u]:ptr[u + 1]]`, in piece order, repeats kept."""

    def __init__(self, ranks: np.ndarray, lo: np.ndarray, hi: np.ndarray, key: np.ndarray):
        order = np.argsort(key, kind="stable")
        ranks, lo, hi, key = ranks[order], lo[order], hi[order], key[order]
        ids, first = boxes.first_seen_ids(np.concatenate((lo, hi), axis=1))
        self.rect_lo, self.rect_hi, self.first_key = lo[first], hi[first], key[first]
        self.ptr, self.ranks = boxes.csr(ids, ranks, len(first))

    def __len__(self) -> int:
        return len(self.rect_lo)


class Copies:
    """Per tensor, the (rect, rank) pairs received since the tensor's layout was last replaced.

    A copy stays valid until the tensor is written again (a new layout), so a second read of the
    same rect by the same rank is free. Copies of a resident tensor (the parts of a sharded home
    its readers fetch) are not kept: each reading task fetches them anew, just before it runs,
    and drops them after, so that a rank never holds more of a sharded parameter than its shard
    and the parameter one task reads."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Layout, np.ndarray]] = {}

    def fresh(self, tensor: str, layout: Layout, reads: Accesses, keep: bool = True) -> np.ndarray:
        """Mask over `reads.ranks`: the readers that get the rect now; they hold a copy after
        unless `keep` is false."""
        if not keep:
            return np.ones(len(reads.ranks), bool)
        counts = np.diff(reads.ptr)
        rects = np.concatenate((reads.rect_lo, reads.rect_hi), axis=1)
        rows = np.concatenate((np.repeat(rects, counts, axis=0), reads.ranks[:, None]), axis=1)
        layout_then, held = self._held.get(tensor, (None, rows[:0]))
        if layout_then is not layout:
            held = rows[:0]
        mask = np.ones(len(rows), bool)
        if len(held):
            ids, _ = boxes.first_seen_ids(np.concatenate((held, rows)))
            mask = ~np.isin(ids[len(held) :], ids[: len(held)])
        self._held[tensor] = (layout, np.concatenate((held, rows[mask])))
        return mask


def _holds(layout: Layout, cells: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Whether each `ranks[i]` holds cell `cells[i]`."""
    if len(layout.holder_ranks) == 0:
        return np.zeros(len(cells), bool)
    if layout.holder_count.max() <= 1:
        owner = layout.holder_ranks[
            np.minimum(layout.holder_ptr[cells], len(layout.holder_ranks) - 1)
        ]
        return (layout.holder_count[cells] == 1) & (owner == ranks)
    span = int(max(ranks.max(initial=0), layout.holder_ranks.max(initial=0))) + 1
    held = np.repeat(np.arange(layout.ncells, dtype=boxes.INDEX), layout.holder_count)
    return np.isin(cells * span + ranks, held * span + layout.holder_ranks)


def fetch(
    tensor: str,
    itemsize: int,
    layout: Layout,
    reads: Accesses,
    fresh: np.ndarray,
    fail: Fail,
) -> TransferBlock:
    """Transfers bringing every rect of `reads` to its fresh readers."""
    box, cell, part_lo, part_hi = boxes.grid_overlaps(
        layout.cut_arrays, reads.rect_lo, reads.rect_hi
    )
    volume = boxes.volumes(part_lo, part_hi)
    unheld = layout.holder_count[cell] == 0
    covered = np.bincount(box, weights=volume, minlength=len(reads))
    short = covered != boxes.volumes(reads.rect_lo, reads.rect_hi)
    bad = short | (np.bincount(box, weights=unheld, minlength=len(reads)) > 0)
    if bad.any():
        u = int(np.argmax(bad))
        nobody = np.flatnonzero(unheld & (box == u))
        if len(nobody):
            part = boxes.to_rect(part_lo[nobody[0]].tolist(), part_hi[nobody[0]].tolist())
            raise fail(f"reads {part!r} of {tensor}, which nobody holds")
        rect = boxes.to_rect(reads.rect_lo[u].tolist(), reads.rect_hi[u].tolist())
        raise fail(f"reads {rect!r} of {tensor}; only part of it was written")
    counts = np.diff(reads.ptr)
    fresh_ptr = np.zeros(len(reads) + 1, boxes.INDEX)
    owner_of = np.repeat(np.arange(len(reads)), counts)
    np.cumsum(np.bincount(owner_of[fresh], minlength=len(reads)), out=fresh_ptr[1:])
    fresh_ranks = reads.ranks[fresh]
    pair_ptr, readers = boxes.gather_ragged(fresh_ptr, fresh_ranks, box)
    pair_of = np.repeat(np.arange(len(box), dtype=boxes.INDEX), np.diff(pair_ptr))
    away = ~_holds(layout, cell[pair_of], readers)
    dsts = readers[away]
    fanout = np.bincount(pair_of[away], minlength=len(box))
    sent = np.flatnonzero(fanout)
    dst_ptr = np.zeros(len(sent) + 1, boxes.INDEX)
    np.cumsum(fanout[sent], out=dst_ptr[1:])
    first_dst = dsts[dst_ptr[:-1]]
    held = layout.holder_count[cell[sent]]
    src = layout.holder_ranks[layout.holder_ptr[cell[sent]] + first_dst % held]
    return TransferBlock(
        tensor,
        False,
        part_lo[sent],
        part_hi[sent],
        volume[sent] * itemsize,
        src,
        dst_ptr,
        dsts,
        reads.first_key[box[sent]],
        sent.astype(boxes.INDEX),
    )


def combine(
    tensor: str,
    itemsize: int,
    layout: Layout,
    contributions: Accesses,
    major: int,
    fail: Fail,
) -> tuple[TransferBlock, list[CollectiveSum]]:
    """Partial-sum transfers and collectives (`CollectiveSum`s) adding
    `contributions` into `layout`; transfers are placed at `major` in the task's list.

    The contributions' parts are grouped by the layout's cell they fall in (`_CellParts`), and
    each cell is summed by the cheapest means that fits it: one contribution into a cell of one
    holder is a partial sum unless it is the holder's own; differing parts into a cell of one
    holder are each sent to it (`_single_holder_rows`); the rest, rare at scale, are
    collectives, or partial sums into replicated cells (`_shared_cells`)."""
    parts = _CellParts.of(layout, contributions)
    if np.any(layout.holder_count[parts.group_cell] == 0):
        raise fail(f"reduces into {tensor} where nothing was zeroed")
    rows, handled = _single_holder_rows(parts, layout, contributions)
    records, collectives = _shared_cells(parts, layout, contributions, np.flatnonzero(~handled))
    block = _partial_sums(tensor, itemsize, parts.part_lo, parts.part_hi, rows, records, major)
    return block, collectives


@dataclass(frozen=True)
class _CellParts:
    """The parts of contributions (`box`: which) within the layout's cells (`cell`), in order
    of group (`group`: a cell's parts, numbered as first seen), the groups' first parts
    (`starts`) and cells, whether every part of a group is the same rect (`equal`), and how many
    parts each has (`entries`)."""

    box: np.ndarray
    cell: np.ndarray
    part_lo: np.ndarray
    part_hi: np.ndarray
    group: np.ndarray
    starts: np.ndarray
    group_cell: np.ndarray
    equal: np.ndarray
    entries: np.ndarray

    @classmethod
    def of(cls, layout: Layout, contributions: Accesses) -> _CellParts:
        box, cell, part_lo, part_hi = boxes.grid_overlaps(
            layout.cut_arrays, contributions.rect_lo, contributions.rect_hi
        )
        group, group_first = boxes.first_seen_ids(cell[:, None])
        order = np.argsort(group, kind="stable")
        box, cell, part_lo, part_hi, group = (
            box[order],
            cell[order],
            part_lo[order],
            part_hi[order],
            group[order],
        )
        ngroups = len(group_first)
        starts = np.searchsorted(group, np.arange(ngroups))
        lead = starts[group]
        differs = np.any(part_lo != part_lo[lead], axis=1) | np.any(
            part_hi != part_hi[lead], axis=1
        )
        equal = np.bincount(group, weights=differs, minlength=ngroups) == 0
        entries = np.bincount(group, minlength=ngroups)
        return cls(box, cell, part_lo, part_hi, group, starts, cell[starts], equal, entries)


def _single_holder_rows(
    parts: _CellParts, layout: Layout, contributions: Accesses
) -> tuple[list[np.ndarray], np.ndarray]:
    """The partial sums into cells of one holder, as rows (group, position, part, src, dst),
    and which groups they handle."""
    box, group, starts, equal = parts.box, parts.group, parts.starts, parts.equal
    ranks_per = np.diff(contributions.ptr)
    holders_per = layout.holder_count[parts.group_cell]
    owner = layout.holder_ranks[layout.holder_ptr[parts.group_cell]]
    # one contribution from one rank: a partial sum unless it is the holder's own
    simple = equal & (parts.entries == 1) & (ranks_per[box[starts]] == 1) & (holders_per == 1)
    g = np.flatnonzero(simple)
    lone = contributions.ranks[contributions.ptr[box[starts[g]]]]
    g, lone = g[lone != owner[g]], lone[lone != owner[g]]
    rows = [np.stack([g, np.zeros_like(g), starts[g], lone, owner[g]], axis=1)]
    # differing parts: every contributor sends its part
    split = ~equal & (holders_per == 1)
    pairs = np.flatnonzero(split[group])
    pair_ptr, senders = boxes.gather_ragged(contributions.ptr, contributions.ranks, box[pairs])
    pair_of = np.repeat(pairs, np.diff(pair_ptr))
    position = np.arange(len(pair_of), dtype=boxes.INDEX)
    keep = senders != owner[group[pair_of]]
    pair_of, senders, position = pair_of[keep], senders[keep], position[keep]
    rows.append(
        np.stack([group[pair_of], position, pair_of, senders, owner[group[pair_of]]], axis=1)
    )
    return rows, simple | split


def _shared_cells(
    parts: _CellParts, layout: Layout, contributions: Accesses, rest: np.ndarray
) -> tuple[
    list[tuple[int, int, int, int, tuple[int, ...]]],
    list[CollectiveSum],
]:
    """The groups `rest` summed otherwise: records (group, position, part, src, dsts) of the
    partial sums into replicated cells, and the collectives. Each group's contributors and
    holders take part; two of them with one holder is one partial sum. Groups with the same
    participants share a collective, and so do groups of one holder with the same
    contributors: a holder among them or not (an extra, `CollectiveSum.contributors`), so
    that a classifier's sums into the 2,048 parts of the layer below are one reduce-scatter,
    not one reduce per part its 1,000 contributors do not hold."""
    records: list[tuple[int, int, int, int, tuple[int, ...]]] = []
    collectives: dict[tuple[int, ...], list[tuple[Rect, tuple[int, ...]]]] = {}
    extras: dict[tuple[int, ...], set[int]] = {}
    union: dict[tuple[int, ...], tuple[tuple[int, ...], frozenset[int]]] = {}
    # the loop reads Python lists: indexing NumPy arrays element by element costs more than
    # the rest of an iteration, and vgg19's weight gradients at 1024 ranks take some 10⁴
    flat = contributions.ranks.tolist()
    ptr = contributions.ptr.tolist()
    holder_ptr, holder_ranks = layout.holder_ptr.tolist(), layout.holder_ranks.tolist()
    box_of = parts.box.tolist()
    firsts = parts.starts[rest]
    for gi, cell_i, first, count, same, lead_lo, lead_hi in zip(
        rest.tolist(),
        parts.group_cell[rest].tolist(),
        firsts.tolist(),
        parts.entries[rest].tolist(),
        parts.equal[rest].tolist(),
        parts.part_lo[firsts].tolist(),
        parts.part_hi[firsts].tolist(),
    ):
        holders = tuple(holder_ranks[holder_ptr[cell_i] : holder_ptr[cell_i + 1]])
        if not same:
            records += _each_part_to_its_holders(gi, first, count, holders, box_of, flat, ptr)
            continue
        key = tuple(box_of[first : first + count])
        if key not in union:
            found = {r for u in key for r in flat[ptr[u] : ptr[u + 1]]}
            union[key] = (tuple(sorted(found)), frozenset(found))
        sorted_ranks, members_set = union[key]
        inside = members_set.issuperset(holders)
        if inside:
            participants = sorted_ranks
        else:
            participants = tuple(sorted(members_set | set(holders)))
        if len(participants) == 1:
            continue
        if len(participants) == 2 and len(holders) == 1:
            src = participants[0] if participants[1] == holders[0] else participants[1]
            records.append((gi, 0, first, src, holders))
            continue
        part = boxes.to_rect(lead_lo, lead_hi)
        if not inside and len(holders) == 1:
            extras.setdefault(sorted_ranks, set()).add(holders[0])
            participants = sorted_ranks
        collectives.setdefault(participants, []).append((part, holders))
    summed = []
    for key, targets in collectives.items():
        outside = extras.get(key)
        if outside:
            summed.append(CollectiveSum(tuple(sorted(outside.union(key))), targets, key))
        else:
            summed.append(CollectiveSum(key, targets, ()))
    return records, summed


def _each_part_to_its_holders(
    group: int,
    first: int,
    count: int,
    holders: tuple[int, ...],
    box_of: list[int],
    flat: list[int],
    ptr: list[int],
) -> list[tuple[int, int, int, int, tuple[int, ...]]]:
    """Group `group`'s differing parts (`first`, `count` of them): each contributor of each
    sends it to every holder but itself."""
    records = []
    for k, p in enumerate(range(first, first + count)):
        u = box_of[p]
        for rank in flat[ptr[u] : ptr[u + 1]]:
            dsts = tuple(h for h in holders if h != rank)
            if dsts:
                records.append((group, k, p, rank, dsts))
    return records


def _partial_sums(
    tensor: str,
    itemsize: int,
    part_lo: np.ndarray,
    part_hi: np.ndarray,
    rows: list[np.ndarray],
    records: list[tuple[int, int, int, int, tuple[int, ...]]],
    major: int,
) -> TransferBlock:
    """One block of reduce transfers from single-destination `rows` (group, position, part, src,
    dst) and general `records` (group, position, part, src, dsts), ordered by group, position."""
    single = np.concatenate(rows) if rows else np.zeros((0, 5), boxes.INDEX)
    group = np.concatenate((single[:, 0], np.array([r[0] for r in records], boxes.INDEX)))
    position = np.concatenate((single[:, 1], np.array([r[1] for r in records], boxes.INDEX)))
    part = np.concatenate((single[:, 2], np.array([r[2] for r in records], boxes.INDEX)))
    src = np.concatenate((single[:, 3], np.array([r[3] for r in records], boxes.INDEX)))
    fanout = np.concatenate(
        (np.ones(len(single), boxes.INDEX), np.array([len(r[4]) for r in records], boxes.INDEX))
    )
    dsts_of = np.concatenate(
        (single[:, 4], np.array([d for r in records for d in r[4]], boxes.INDEX))
    )
    span = int(position.max(initial=0)) + 1
    order = np.argsort(group * span + position, kind="stable")
    if records:
        ptr = np.zeros(len(fanout) + 1, boxes.INDEX)
        np.cumsum(fanout, out=ptr[1:])
        dst_ptr, dsts = boxes.gather_ragged(ptr, dsts_of, order)
    else:  # one destination each
        dst_ptr, dsts = np.arange(len(order) + 1, dtype=boxes.INDEX), dsts_of[order]
    lo, hi = part_lo[part[order]], part_hi[part[order]]
    return TransferBlock(
        tensor,
        True,
        lo,
        hi,
        boxes.volumes(lo, hi) * itemsize,
        src[order],
        dst_ptr,
        dsts,
        np.full(len(order), major, boxes.INDEX),
        np.arange(len(order), dtype=boxes.INDEX),
    )
