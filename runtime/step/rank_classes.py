"""Ranks whose programs are alike, built once: the programs of a plan's ranks found by building
one rank of each class and moving its program to the others.

In a data-parallel step every rank but the one holding the loss runs the same tasks on rects
that differ only in where they lie along the batch; a spatial step's inner ranks differ only
along the rows. A rank's builder (`rank_builder.Builder`) decides everything it does by
comparing rects of one tensor with each other (overlaps, coverage, differences, bounding boxes)
and by which ranks are the ends of its messages and the holders of its collectives' targets.
Those decisions do not change when every rect of a tensor moves by the same offset. So:

- Each rank's *signature* is everything its builder is told, in the order told (`task_events`):
  its pieces' requirements, its messages (its end of each, bytes, when posted), its part in each
  collective it joins (the targets and whether it holds each, in the order it joins them: not
  which of a task's collectives it joins, so that the ranks of a batch group's channel sums
  are alike whatever their group) and the cells it holds of each layout.
  The bytes its collectives' hops send, which its builder only adds up, are kept beside
  (`RankClasses.hop_bytes`), so that the uneven chunks of a ring do not split the ranks of a
  data-parallel step into classes; the memory model places a rank's buffers apart where its
  adding hops' buffers differ from its class's (`buffers.hop_buffers`). Each rect is written
  relative to the *frame* of its tensor on that rank: the low corner of the first rect of that
  tensor the rank is told of.
- The signatures are read task by task from the plan's arrays for every rank at once
  (`_piece_rows`, `_message_rows`, `_collective_rows`, `_held_cells`, `_Frames.relative_rows`),
  not piece by piece: each task adds columns of ids to the ranks' table, one per distinct run
  of rows a rank is told (`_Told`), and ranks whose columns and earlier class agree share a
  class after it. A message's row carries its end's place among the ends its rank is told of
  the task, so that the order told is part of the signature across tensors too. A rank's
  pieces are made only where it is built (`task_events.PiecesByRank`), and the step's events
  are read as they are made (`task_events.each_task_event`): telling ranks apart stops, and no
  more events are made, once they fall into too many classes.
- Ranks with equal signatures form a class. Telling them the same things with every rect of a
  tensor moved by the difference of their frames, their builders make the same decisions: the
  program of one is that of another with its rects moved, and with each message replaced by the
  rank's own message told at the same point, and each collective by the rank's own joined at the
  same point.
- `shared_programs.SharedPrograms` moves those programs from the class's first rank's when asked for. Pieces
  are the rank's own. Fusing updates into their gradients' kernels compares rects of two
  tensors once (an update's parameters against its gradient), and that comparison is part of
  the signature: the first rank's fused program moves as it is.
- The step's simulators and the memory model read a class's program once for all its ranks.
- Telling ranks apart gives up once they fall into more classes than `SHARED_AT_MOST` of their
  count (a mixture of grids per layer, uneven spatial cuts): then every rank is built.

`tests/runtime/step/test_rank_classes.py` holds the programs moved equal to the programs built,
field for field, on every kind of plan, and the step and memory read once per class equal to those read
rank by rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import numpy as np

from partitioner import boxes
from partitioner.layout import Layout
from partitioner.pieces import PieceSet
from partitioner.plan import Plan
from runtime.step.rank_messages import Message
from runtime.step.rank_program import Collective
from runtime.step.task_events import TaskEvents


@dataclass
class RankClasses:
    #: per class, its ranks (the first, its representative, is built)
    members: dict[int, list[int]]
    #: each rank's frame of each tensor (`frames_of`)
    _frames: _Frames
    #: per rank, the messages it was told of, in the order told (once per end it is)
    messages: dict[int, list[Message]]
    #: per rank, the collectives it joins, in the order told
    collectives: dict[int, list[Collective]]
    #: per rank, the bytes its collectives' hops send: ranks of a class may send different
    #: shares of a collective (a ring cuts n elements into chunks of ⌊n/p⌋ and ⌈n/p⌉), which
    #: their builders only add up
    hop_bytes: dict[int, int]

    def frames_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Per tensor `rank` was told of, the low corner of the first rect of it told."""
        return self._frames.of_rank(rank)

    def own_messages(self, source: int, rank: int) -> dict[int, Message]:
        """Per message `source` was told of (by sequence number), the message `rank` of its
        class was told at the same point."""
        return dict(zip((m.seq for m in self.messages[source]), self.messages[rank]))

    def own_collectives(self, source: int, rank: int) -> dict[int, Collective]:
        """Per collective `source` joins (by sequence number), the collective `rank` of its
        class joins at the same point."""
        return dict(zip((c.seq for c in self.collectives[source]), self.collectives[rank]))


class _Frames:
    """Each rank's frame of each tensor: the low corner of the first rect of it the rank is told
    of, kept as one array per tensor over the ranks' slots (their places in `ranks`)."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.slot = {rank: slot for slot, rank in enumerate(ranks)}
        self._by_tensor: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        #: the tensors every rank has a frame of
        self._every_known: set[str] = set()

    def _arrays(self, tensor: str, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        found = self._by_tensor.get(tensor)
        if found is None:
            n = len(self.slot)
            found = self._by_tensor[tensor] = (np.zeros((n, ndim), np.int64), np.zeros(n, bool))
        return found

    def relative_rows(
        self, tensor: str, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> np.ndarray:
        """Rows of rects told in this order to the ranks in `slots`, each as its low and high
        corners relative to its rank's frame, which the first of them sets where it has none."""
        frame, known = self._arrays(tensor, lo.shape[1])
        if tensor not in self._every_known:
            new = ~known[slots]
            if new.any():
                first_slots, first_rows = np.unique(slots[new], return_index=True)
                frame[first_slots] = lo[new][first_rows]
                known[first_slots] = True
                if known.all():
                    self._every_known.add(tensor)
        at = frame[slots]
        return np.concatenate((lo - at, hi - at), axis=1)

    def of_rank(self, rank: int) -> dict[str, tuple[int, ...]]:
        slot = self.slot[rank]
        return {
            tensor: tuple(frame[slot].tolist())
            for tensor, (frame, known) in self._by_tensor.items()
            if known[slot]
        }


class _Told:
    """What each rank is told of one task, column by column, each an int per rank's slot (0:
    nothing): ranks with equal columns and an equal class before fall into one class after."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.columns: list[np.ndarray] = []

    def rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """A column from rows of ints told to the ranks in `slots`, in the order told: each
        rank's rows in that order, one id per distinct run of rows; none where every rank is
        told one row, all alike, which tells no two apart (each rank's part of a data split)."""
        if not len(slots):
            return
        if (slots[1:] > slots[:-1]).all():  # told in rank order, a row each: no sort
            starts = np.arange(len(slots))
        else:
            order = np.argsort(slots, kind="stable")
            slots, rows = slots[order], rows[order]
            starts = boxes.run_starts(slots[1:] != slots[:-1])
        column = np.zeros(self.n, np.int64)
        if len(starts) == len(slots) and (rows == rows[:1]).all():
            if len(slots) == self.n:  # distinct slots, so every rank's
                return
            column[slots] = 1
        else:
            ends = boxes.run_ends(starts, len(slots))
            ids: dict[bytes, int] = {}
            for slot, start, end in zip(slots[starts].tolist(), starts.tolist(), ends.tolist()):
                column[slot] = ids.setdefault(rows[start:end].tobytes(), len(ids) + 1)
        self.columns.append(column)

    def settle(self, told: np.ndarray) -> np.ndarray:
        """Each rank's class after this task: ranks told the same before and now share one."""
        if not self.columns:
            return told
        return boxes.first_seen_ids(np.stack([told, *self.columns], axis=1))[0]


#: sharing gives up once the ranks fall into more classes than this share of them, where
#: building one per class saves too little to repay telling them apart: on DenseNet-121's 64
#: ranks telling them apart takes about 1.4 s, about what building 7 ranks' programs does, and
#: a mixture of its data-parallel layers with a classifier cut 4 by batch and 16 by channels
#: has 17 classes (the channel sums' 16 places in a group, rank 0 apart)
SHARED_AT_MOST = 0.5


def rank_classes(
    plan: Plan,
    events: Iterable[TaskEvents],
    ranks: Sequence[int],
    most: int,
) -> RankClasses | None:
    """The classes of `ranks` whose builders are told the same things up to where their rects
    lie: each rank's signature, following `task_events.build_each` call for call, task by task,
    each task's told to every rank at once from the plan's arrays. None, and no more of
    `events` read, as soon as there are more than `most` (`programs.build_programs` allows
    `SHARED_AT_MOST` of the ranks' count, or fewer within its budget)."""
    ranks = list(ranks)
    frames = _Frames(ranks)
    slot_of = np.full(max(ranks, default=0) + 1, -1, np.int64)
    slot_of[ranks] = np.arange(len(ranks))
    told = np.zeros(len(ranks), np.int64)
    messages: dict[int, list[Message]] = {rank: [] for rank in ranks}
    collectives: dict[int, list[Collective]] = {rank: [] for rank in ranks}
    hop_bytes = dict.fromkeys(ranks, 0)
    requirement_ids: dict[tuple, int] = {}
    collective_row_ids: dict[tuple, int] = {}

    #: per layout (by id: the plan and the events hold them), its held cells: a layout stays
    #: a tensor's across the tasks that leave it as it is
    cells_of: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    #: the (tensor, layout) pairs whose held cells were told: told again, their rows (relative
    #: to frames set by then) are the same, and tell no ranks apart that they did not before
    told_held: set[tuple[str, int]] = set()

    def held(now: _Told, holdings: Mapping[str, Layout]) -> None:
        for name, layout in holdings.items():
            if (name, id(layout)) in told_held:
                continue
            told_held.add((name, id(layout)))
            found = cells_of.get(id(layout))
            if found is None:
                found = cells_of[id(layout)] = _held_cells(layout, slot_of)
            slots, lo, hi = found
            if len(slots):
                now.rows(slots, frames.relative_rows(name, slots, lo, hi))

    homes = _Told(len(ranks))
    held(homes, plan.homes)
    told = homes.settle(told)
    if told.max(initial=0) + 1 > most:
        return None
    for event in events:
        now = _Told(len(ranks))
        updates = event.task.op == "update"
        for piece_set in event.mine.piece_sets:
            slots, rows = _piece_rows(piece_set, slot_of, frames, updates, requirement_ids)
            now.rows(slots, rows)
        if event.messages:
            for slots, rows in _message_rows(event.messages, slot_of, frames, messages):
                now.rows(slots, rows)
        if event.collectives:
            joined = []
            for collective, sent, start in event.collectives:
                for rank, nbytes in sent.items():
                    if rank in hop_bytes:
                        hop_bytes[rank] += nbytes
                slots, rows = _collective_rows(collective, start, slot_of, frames)
                for slot in slots.tolist():
                    collectives[ranks[slot]].append(collective)
                joined.append((slots, _row_ids(rows, collective_row_ids)))
            # one column for all the task's collectives: a rank's part in each it joins, in
            # order, whichever of them it joins
            now.rows(
                np.concatenate([slots for slots, _ in joined]),
                np.concatenate([ids for _, ids in joined])[:, None],
            )
        held(now, event.holdings)
        told = now.settle(told)
        if told.max(initial=0) + 1 > most:
            return None
    members: dict[int, list[int]] = defaultdict(list)
    for rank, found in zip(ranks, told.tolist()):
        members[found].append(rank)
    return RankClasses(
        {group[0]: group for group in members.values()}, frames, messages, collectives, hop_bytes
    )


def _row_ids(rows: np.ndarray, ids: dict[tuple, int]) -> np.ndarray:
    """An id per row of `rows`, equal for equal rows of any array given the same `ids`."""
    if not rows.size:
        return np.full(len(rows), ids.setdefault((rows.shape[1], b""), len(ids) + 1), np.int64)
    unique, inverse = np.unique(rows, axis=0, return_inverse=True)
    width = rows.shape[1]
    found = [ids.setdefault((width, row.tobytes()), len(ids) + 1) for row in unique]
    return np.asarray(found, np.int64)[inverse.reshape(-1)]


def _message_rows(
    told: Sequence[Message],
    slot_of: np.ndarray,
    frames: _Frames,
    messages: dict[int, list[Message]],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per tensor of a task's messages `told`, (the slot of each end told, in the order told,
    and its row: its place among the ends its rank is told of the task, whether it is the
    source and the destination, the rect relative to the rank's frame, the bytes, when it is
    posted and whether it is a partial sum); each message also kept in `messages` for each end
    it has among the ranks told, in the order told."""
    count = len(told)
    # src, dst, nbytes, post_after, reduce of every message, read in one pass
    facts = np.fromiter(chain.from_iterable(map(_FACTS, told)), np.int64, 5 * count)
    facts = facts.reshape(count, 5)
    ends = facts[:, :2].reshape(-1)
    end_slots = told_slots(ends, slot_of)
    kept = np.flatnonzero(end_slots >= 0)
    for at in kept.tolist():
        messages[int(ends[at])].append(told[at // 2])
    end_slots = end_slots[kept]
    # an end's place among its rank's ends, so that ranks told the same messages in another
    # order (across tensors) differ
    order = np.argsort(end_slots, kind="stable")
    sorted_slots = end_slots[order]
    starts = boxes.run_starts(sorted_slots[1:] != sorted_slots[:-1])
    place = np.empty(len(kept), np.int64)
    place[order] = boxes.places_in_runs(starts, len(kept))
    index = kept // 2
    rank = ends[kept]
    names = [m.tensor for m in told]
    ids = {name: i for i, name in enumerate(dict.fromkeys(names))}
    tensor_of = np.fromiter((ids[name] for name in names), np.int64, count)[index]
    out = []
    for tensor, i in ids.items():
        picked = np.flatnonzero(tensor_of == i)
        if not len(picked):
            continue
        mine = index[picked]
        rects = [told[j].rect for j in mine.tolist()]
        ndim = len(rects[0].lo)
        lo = np.fromiter(chain.from_iterable(r.lo for r in rects), np.int64, ndim * len(rects))
        hi = np.fromiter(chain.from_iterable(r.hi for r in rects), np.int64, ndim * len(rects))
        slots = end_slots[picked]
        relative = frames.relative_rows(tensor, slots, lo.reshape(-1, ndim), hi.reshape(-1, ndim))
        src, dst = facts[mine, 0], facts[mine, 1]
        rows = np.column_stack(
            (place[picked], src == rank[picked], dst == rank[picked], relative, facts[mine, 2:])
        )
        out.append((slots, rows.astype(np.int64)))
    return out


#: a message's ends, bytes, post point and whether it is a partial sum, as `_message_rows`
#: reads them
_FACTS = itemgetter(3, 4, 5, 7, 8)


def _collective_rows(
    collective: Collective, start: int, slot_of: np.ndarray, frames: _Frames
) -> tuple[np.ndarray, np.ndarray]:
    """(the slot of each participant told, and its row: per target, in order, the target's
    rect relative to the participant's frame of the tensor and whether it holds the target;
    for an all-gather, which every participant holds whole and whose targets its builder never
    compares, the position it starts after and its size)."""
    participants = np.asarray(collective.reduction.participants, np.int64)
    slots = told_slots(participants, slot_of)
    told = slots >= 0
    participants, slots = participants[told], slots[told]
    if collective.owners:
        size = sum(rect.volume for rect, _ in collective.targets)
        # four columns, which no sum's row has (2·ndim + 1 a target)
        row = np.array([[-1, start, len(collective.targets), size]], np.int64)
        return slots, np.tile(row, (len(slots), 1))
    tensor = collective.reduction.tensor
    columns = []
    for rect, holders in collective.targets:
        ndim = len(rect.lo)
        lo = np.broadcast_to(np.asarray(rect.lo, np.int64), (len(slots), ndim))
        hi = np.broadcast_to(np.asarray(rect.hi, np.int64), (len(slots), ndim))
        columns.append(frames.relative_rows(tensor, slots, lo, hi))
        columns.append(np.isin(participants, holders).astype(np.int64)[:, None])
    rows = np.concatenate(columns, axis=1) if columns else np.zeros((len(slots), 0), np.int64)
    return slots, rows


def _piece_rows(
    piece_set: PieceSet,
    slot_of: np.ndarray,
    frames: _Frames,
    updates: bool,
    requirement_ids: dict[tuple, int],
) -> tuple[np.ndarray, np.ndarray]:
    """(the slot of each rank told a piece of `piece_set`, in the plan's order, and a row of
    ints per such (piece, rank): the set's requirements (tensors and privileges), whether an
    update steps its gradient's rect (`_steps_its_gradients_rect`), and each requirement's rect
    relative to the rank's frame of its tensor)."""
    pieces, slots = told_pieces(piece_set, slot_of)
    key = requirement_key(piece_set)
    columns = [
        np.full((len(pieces), 1), requirement_ids.setdefault(key, len(requirement_ids)), np.int64)
    ]
    if updates:
        columns.append(_steps_its_gradients_rect(piece_set, pieces)[:, None])
    by_tensor: dict[str, list[int]] = defaultdict(list)
    for j, req in enumerate(piece_set.requirements):
        by_tensor[req.tensor].append(j)
    relative: dict[int, np.ndarray] = {}
    for tensor, slots_of_tensor in by_tensor.items():
        if len(slots_of_tensor) == 1:
            j = slots_of_tensor[0]
            lo, hi = piece_set.req_lo[j][pieces], piece_set.req_hi[j][pieces]
            relative[j] = frames.relative_rows(tensor, slots, lo, hi)
            continue
        # one tensor in several requirements: its rects told piece by piece, in their order
        lo = np.stack([piece_set.req_lo[j][pieces] for j in slots_of_tensor], axis=1)
        hi = np.stack([piece_set.req_hi[j][pieces] for j in slots_of_tensor], axis=1)
        ndim = lo.shape[2]
        rows = frames.relative_rows(
            tensor,
            np.repeat(slots, len(slots_of_tensor)),
            lo.reshape(-1, ndim),
            hi.reshape(-1, ndim),
        ).reshape(len(pieces), len(slots_of_tensor), 2 * ndim)
        for at, j in enumerate(slots_of_tensor):
            relative[j] = rows[:, at]
    columns += [relative[j] for j in range(len(piece_set.requirements))]
    return slots, np.concatenate(columns, axis=1) if columns else np.zeros((len(slots), 0))


def told_pieces(piece_set: PieceSet, slot_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the piece and the rank's slot of each (piece, rank) of `piece_set` told to a rank among
    `slot_of`'s, in the plan's order): a rank twice among a piece's ranks is told it once."""
    counts = np.diff(piece_set.rank_ptr)
    pieces = np.repeat(np.arange(len(piece_set), dtype=np.int64), counts)
    ranks = piece_set.ranks
    slots = told_slots(ranks, slot_of)
    keep = slots >= 0
    if len(ranks) > 1:
        keep[1:] &= (pieces[1:] != pieces[:-1]) | (ranks[1:] != ranks[:-1])
    return pieces[keep], slots[keep]


def requirement_key(piece_set: PieceSet) -> tuple:
    """What a rank is told of `piece_set`'s requirements besides their rects."""
    return tuple((req.tensor, req.privilege, req.role) for req in piece_set.requirements)


def _held_cells(layout: Layout, slot_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the slot of each holder of each cell, cell by cell, and the cells' corners) of `layout`
    (`Layout.held_cells`), for the holders among the ranks told."""
    if not len(layout.holder_ranks):
        return np.zeros(0, np.int64), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.int64)
    holders, lo, hi = layout.held_cells()
    slots = told_slots(holders, slot_of)
    keep = slots >= 0
    return slots[keep], lo[keep].astype(np.int64), hi[keep].astype(np.int64)


def told_slots(ranks: np.ndarray, slot_of: np.ndarray) -> np.ndarray:
    """Each rank's slot among the ranks told (`slot_of`), -1 for a rank not told."""
    ranks = ranks.astype(np.int64)
    slots = np.full(len(ranks), -1, np.int64)
    inside = ranks < len(slot_of)
    slots[inside] = slot_of[ranks[inside]]
    return slots


def _steps_its_gradients_rect(piece_set: PieceSet, pieces: np.ndarray) -> np.ndarray:
    """Per piece of an update, whether it steps the rect of its gradient it reads (1) or not
    (0): the one comparison of rects of two tensors that fusing updates into their gradients'
    kernels makes (`update_fusion.fuse_into_gradients`), so that it too is the same on every
    rank of a class."""
    roles = {req.role: j for j, req in enumerate(piece_set.requirements)}
    params, gradient = roles.get("params"), roles.get("gradient")
    if params is None or gradient is None:
        return np.zeros(len(pieces), np.int64)
    same = np.all(piece_set.req_lo[params] == piece_set.req_lo[gradient], axis=1) & np.all(
        piece_set.req_hi[params] == piece_set.req_hi[gradient], axis=1
    )
    return same[pieces].astype(np.int64)
