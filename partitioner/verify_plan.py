"""`verify_plan(graph, plan)`: the invariants of a plan, checked by brute force.

The checks recompute from the pieces and transfers alone (their objects, or for the sums the
arrays the objects view), without the layouts the planner used, so they test the planner rather
than restate it:

1. coverage: the pieces of every partitioned task lie in its space, are disjoint and cover it;
2. producers: every element a piece reads was written by exactly one piece of the latest earlier
   task that writes the tensor (a homed task's piece, such as the zeroing of a parameter's
   gradient, is run by every holder of its cell, and each holds it), or, for a resident tensor,
   lies in exactly one cell of its home;
3. messages: what reaches a rank for one task and tensor (a copy, or a part an all-gather brings
   from a participant holding it) is disjoint from what it holds and from
   every other part sent to it, lies in a rect the rank reads afresh (one it has not read since
   the tensor was last written: the planner keeps copies by read rect, so a second read of the
   same rect is free, and a read of another rect fetches each cell's part whole, even where it
   overlaps a copy), and together with what it holds and the copies it received since then
   covers what its pieces read. Copies of a resident tensor (the parts of a sharded home) are
   dropped after the task that fetched them: the next reader fetches them anew.
4. sums: the partial sums of a task whose grid cuts a dim it sums over land in rects that cut
   its output into disjoint parts covering it (one sum per element), and where a partitioned
   task later reads a tensor that tasks reduce into, every part of
   every piece's contribution reaches every rank holding that part, by the rank's own piece, a
   partial sum sent to it, or a collective that both take part in and whose target the holder
   holds (a sum held by several ranks, such as BatchNorm's parameter gradients read by its
   input gradient, is complete on each).

Small sets of boxes are compared pair by pair. Large ones (a task's pieces, a tensor's writers, the
parts of a transpose arriving at one rank) are counted instead on the grid cut at every bound of
the boxes (`cell_grid.py`), so a check costs about the number of cells rather than the square of
the number of boxes. The ranks of one task
and tensor are counted on one grid, a layer per rank, where that grid is not much finer than
theirs (see `_count_messages`): a model-parallel layer's 64 readers cost one pass, not 64 calls.
Sums are checked the same way over (cell, contributor, holder) triples (`_check_sums`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from legion_nn.errors import VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner import boxes
from partitioner.cell_grid import CellGrid, arrays, join
from partitioner.plan import Piece, Plan
from partitioner.task_plan import Reduction, TaskPlan

#: boxes beyond which sets are counted on a grid rather than compared pair by pair
PAIRWISE = 24
#: cells per rank beyond which ranks' messages are counted rank by rank rather than on one
#: grid (about what a call per rank costs, in cells counted: a fraction of a millisecond)
RANK_CELLS = 2048
#: cells beyond which the ranks counted on one grid are split in halves (its memory)
BATCH_CELLS = 1 << 21


@dataclass
class _Copies:
    """What a rank received of a tensor since the tensor was last written, and what it read."""

    parts: list[Rect] = field(default_factory=list)
    reads: set[Rect] = field(default_factory=set)


def verify_plan(graph: TaskGraph, plan: Plan) -> None:
    """Raise `VerifyError` naming the first broken invariant."""
    #: per tensor, the rects of the pieces of its latest writer, and per rank those it holds
    writers: dict[str, tuple[list[Rect], dict[int, list[Rect]]]] = {
        name: _home_holdings(home, plan.nranks)
        for name, home in plan.homes.items()
        if graph.tensors[name].resident
    }
    copies: dict[tuple[str, int], _Copies] = defaultdict(_Copies)
    read = _read_by_partitioned_tasks(graph, plan)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task_plan.grid is None:
            _record_writes(graph, task, task_plan.pieces, writers, copies)
            continue
        pieces = task_plan.pieces
        _check_coverage(task.name, task.space, [p.rect for p in pieces])
        needed: dict[tuple[str, int], list[Rect]] = defaultdict(list)
        for piece in pieces:
            for req in piece.requirements:
                if not req.privilege.reads or req.read_rect is None or req.read_rect.is_empty():
                    continue
                needed[(req.tensor, piece.ranks[0])].append(req.read_rect)
        by_tensor: dict[str, list[Rect]] = defaultdict(list)
        for (tensor, _), rects in needed.items():
            by_tensor[tensor].extend(rects)
        for tensor, rects in by_tensor.items():
            if tensor not in writers:
                raise VerifyError(f"{task.name} reads {tensor}, never written before")
            _check_producers(task.name, tensor, rects, writers[tensor][0])
        received: dict[tuple[str, int], list[Rect]] = defaultdict(list)
        for transfer in task_plan.transfers:
            if transfer.reduce:
                continue
            for dst in transfer.dsts:
                received[(transfer.tensor, dst)].append(transfer.rect)
        for _, gather in task_plan.gathered:
            _check_gather(task.name, gather, writers)
            for (rect, holders), owner in zip(gather.targets, gather.owners):
                for rank in holders:
                    if rank != owner:
                        received[(gather.tensor, rank)].append(rect)
        many: dict[str, list[_RankBoxes]] = defaultdict(list)
        for key in set(needed) | set(received):
            held = writers[key[0]][1].get(key[1], []) if key[0] in writers else []
            _check_not_again(task.name, key, needed.get(key, []), copies[key].reads, received)
            boxes_of = (needed.get(key, []), held, copies[key].parts, received.get(key, []))
            if sum(len(b) for b in boxes_of[1:]) > PAIRWISE:
                many[key[0]].append((key[1], *boxes_of))
            else:
                _check_messages(task.name, key, *boxes_of)
        for tensor, ranks in many.items():
            _count_messages(task.name, tensor, ranks)
        for key, parts in received.items():
            copies[key].parts.extend(parts)
        for key, rects in needed.items():
            copies[key].reads.update(rects)
        for key in [k for k in copies if graph.tensors[k[0]].resident]:
            del copies[key]  # a sharded home's parts are fetched anew by each reader
        opened = _sum_targets(task, task_plan)
        reduced = {
            r.tensor
            for piece_set in task_plan.piece_sets
            for r in piece_set.requirements
            if r.privilege is Privilege.REDUCE
        }
        for tensor in reduced:
            held = opened[tensor][1] if tensor in opened else writers.get(tensor, (0, None))[1]
            carrier = _carrier(graph, plan, task.name, tensor, task_plan.deferred.get(tensor))
            if tensor in read and held is not None:
                _check_sums(task.name, tensor, task_plan, held, plan.nranks, carrier)
        summed = frozenset(j for piece_set in task_plan.piece_sets for j, *_ in piece_set.sums)
        _record_writes(graph, task, pieces, writers, copies, summed)
        for tensor, written in opened.items():
            writers[tensor] = written
            for key in [k for k in copies if k[0] == tensor]:
                del copies[key]


def _check_gather(
    task: str, gather: Reduction, writers: dict[str, tuple[list[Rect], dict[int, list[Rect]]]]
) -> None:
    """An all-gather that brings `task` its reads (`TaskPlan.gathered`): each part comes from a
    participant that holds it."""
    held = writers.get(gather.tensor, ([], {}))[1]
    for (rect, _), owner in zip(gather.targets, gather.owners):
        if owner not in gather.participants or not rect.covered_by(held.get(owner, [])):
            raise VerifyError(
                f"{task}: the all-gather of {gather.tensor} sends {rect!r} from rank {owner}, "
                "which does not hold it"
            )


def _home_holdings(home, nranks: int) -> tuple[list[Rect], dict[int, list[Rect]]]:
    """A resident tensor's home as `verify_plan` records writers: its cells, and per rank the
    cells it holds."""
    held = {rank: home.held_by(rank) for rank in np.unique(home.holder_ranks).tolist()}
    shape = boxes.grid_shape(home.cut_arrays)
    cells = [
        home.cell_rect(tuple(int(i) for i in np.unravel_index(index, shape)))
        for index in home.holders
    ]
    return cells, held


def _read_by_partitioned_tasks(graph: TaskGraph, plan: Plan) -> set[str]:
    """The tensors some partitioned task reads (the sums whose completeness matters)."""
    return {
        r.tensor
        for task, task_plan in zip(graph.tasks, plan.tasks)
        if task_plan.grid is not None
        for r in task.requirements
        if r.privilege.reads and r.privilege is not Privilege.REDUCE
    }


def _record_writes(
    graph: TaskGraph,
    task: Task,
    pieces: Sequence[Piece],
    writers: dict[str, tuple[list[Rect], dict[int, list[Rect]]]],
    copies: dict[tuple[str, int], _Copies],
    summed: frozenset[int] = frozenset(),
) -> None:
    """A task's writes replace what is held of each tensor it writes: every rank of a piece
    holds the piece's rect (a homed piece is run, and held, by every holder of its cell)."""
    for req_index, req in enumerate(task.requirements):
        if not req.privilege.writes or req.privilege is Privilege.REDUCE:
            continue
        if req_index in summed:
            continue  # partial sums, held where `PieceSet.sums` says (`_sum_targets`)
        if graph.tensors[req.tensor].resident:
            continue  # its home holds what its readers read
        sources: list[Rect] = []
        held: dict[int, list[Rect]] = defaultdict(list)
        for piece in pieces:
            rect = piece.requirements[req_index].write_rect
            if not rect.is_empty():
                sources.append(rect)
                for rank in piece.ranks:
                    held[rank].append(rect)
        writers[req.tensor] = (sources, held)
        for key in [k for k in copies if k[0] == req.tensor]:
            del copies[key]


def _sum_targets(
    task: Task, task_plan: TaskPlan
) -> dict[str, tuple[list[Rect], dict[int, list[Rect]]]]:
    """Per tensor whose partial sums the task's pieces write (a grid cutting a reduction dim),
    the rects the sums land in and who holds each; they must cut the rect the task writes into
    disjoint parts that cover it: one sum per element."""
    out = {}
    for piece_set in task_plan.piece_sets:
        for j, ranks, lo, hi in piece_set.sums:
            req = task.requirements[j]
            rects = boxes.to_rects(lo, hi)
            _check_coverage(f"{task.name} (the sums of {req.tensor})", req.write_rect, rects)
            held: dict[int, list[Rect]] = defaultdict(list)
            for rank, rect in zip(ranks.tolist(), rects):
                held[rank].append(rect)
            out[req.tensor] = (rects, held)
    return out


def _carrier(
    graph: TaskGraph, plan: Plan, task: str, tensor: str, later: int | None
) -> TaskPlan | None:
    """The plan of the task whose collective sums `task`'s contributions to `tensor`, where a
    later one does (`TaskPlan.deferred`): every task from this one to it only adds into the
    tensor, so nothing reads a copy that holds one rank's partial sums."""
    if later is None:
        return None
    first = graph.index(task)
    if later <= first:
        raise VerifyError(f"{task}: its sum into {tensor} is deferred to an earlier task")
    for index in range(first, later + 1):
        for req in graph.tasks[index].requirements:
            if req.tensor == tensor and req.privilege is not Privilege.REDUCE:
                raise VerifyError(
                    f"{task}: its sum into {tensor} is deferred past "
                    f"{graph.tasks[index].name}, which {req.privilege.name.lower()}s it"
                )
    return plan.tasks[later]


def _check_sums(
    task: str,
    tensor: str,
    task_plan: TaskPlan,
    held: dict[int, list[Rect]],
    nranks: int,
    carrier: TaskPlan | None = None,
) -> None:
    """Every part of every piece's contribution to `tensor` reaches every rank holding that
    part: the rank itself, a partial sum sent to the holder, or a collective both take part in
    whose target the holder holds (the collective of `carrier`, where a later task's sums the
    contributions: `TaskPlan.deferred`).

    Read from the plan's arrays and counted on the grid cut at every bound of the
    contributions, holdings, partial sums and targets: each cell lies wholly inside or outside
    each of them, so the check is whether every (cell, contributor, holder) that must meet is
    one that a partial sum or a collective joins."""
    src, c_lo, c_hi = _contributions(task_plan, tensor)
    if not len(src) or not held:
        return
    ndim = c_lo.shape[1]
    holder = np.array([rank for rank, rects in held.items() for _ in rects], boxes.INDEX)
    h_lo, h_hi = boxes.from_rects([rect for rects in held.values() for rect in rects], ndim)
    s_src, s_dst, s_lo, s_hi = _partial_sums(task_plan, tensor, ndim)
    reductions = [r for r in (carrier or task_plan).reductions if r.tensor == tensor]
    targets = [(k, h, rect) for k, r in enumerate(reductions) for rect, hs in r.targets for h in hs]
    t_reduction = np.array([k for k, _, _ in targets], boxes.INDEX)
    t_holder = np.array([h for _, h, _ in targets], boxes.INDEX)
    t_lo, t_hi = boxes.from_rects([rect for _, _, rect in targets], ndim)
    # a sum adds what its contributors hold, not its extra participants' (`summed_from`)
    m_reduction = np.array(
        [k for k, r in enumerate(reductions) for _ in r.summed_from], boxes.INDEX
    )
    m_rank = np.array([s for r in reductions for s in r.summed_from], boxes.INDEX)

    every = (c_lo, c_hi, h_lo, h_hi, s_lo, s_hi, t_lo, t_hi)
    cuts = [np.unique(np.concatenate([a[:, d] for a in every])) for d in range(ndim)]

    def key(cell: np.ndarray, source: np.ndarray, sink: np.ndarray) -> np.ndarray:
        return (cell * nranks + source) * nranks + sink

    c_box, c_cell, _, _ = boxes.grid_overlaps(cuts, c_lo, c_hi)
    h_box, h_cell, _, _ = boxes.grid_overlaps(cuts, h_lo, h_hi)
    left, right = join(c_cell, h_cell)
    apart = src[c_box[left]] != holder[h_box[right]]
    left, right = left[apart], right[apart]
    need = key(c_cell[left], src[c_box[left]], holder[h_box[right]])
    s_box, s_cell, _, _ = boxes.grid_overlaps(cuts, s_lo, s_hi)
    t_box, t_cell, _, _ = boxes.grid_overlaps(cuts, t_lo, t_hi)
    by_target, by_member = join(t_reduction[t_box], m_reduction)
    arrived = np.concatenate(
        (
            key(s_cell, s_src[s_box], s_dst[s_box]),
            key(t_cell[by_target], m_rank[by_member], t_holder[t_box[by_target]]),
        )
    )
    missing = np.flatnonzero(~np.isin(need, arrived))
    if len(missing):
        i, j = c_box[left[missing[0]]], h_box[right[missing[0]]]
        part = boxes.to_rect(
            np.maximum(c_lo[i], h_lo[j]).tolist(), np.minimum(c_hi[i], h_hi[j]).tolist()
        )
        raise VerifyError(
            f"{task}: rank {src[i]}'s partial sum of {part!r} of {tensor} "
            f"never reaches rank {holder[j]}, which holds it"
        )


def _contributions(task_plan: TaskPlan, tensor: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, lo, hi) of every piece's reduction into `tensor`."""
    found = [
        (pieces.owners, pieces.req_lo[j], pieces.req_hi[j])
        for pieces in task_plan.piece_sets
        for j, req in enumerate(pieces.requirements)
        if req.tensor == tensor and req.privilege is Privilege.REDUCE
    ]
    if not found:
        return np.zeros(0, boxes.INDEX), *boxes.empty(0)
    src, lo, hi = zip(*found)
    return np.concatenate(src), np.concatenate(lo), np.concatenate(hi)


def _partial_sums(
    task_plan: TaskPlan, tensor: str, ndim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source, destination, lo, hi) of every partial sum of `tensor`, once per destination."""
    blocks = [b for b in task_plan.transfer_set.blocks if b.reduce and b.tensor == tensor]
    none = np.zeros(0, boxes.INDEX)
    src = [np.repeat(b.src, b.fanout) for b in blocks]
    lo = [np.repeat(b.lo, b.fanout, axis=0) for b in blocks]
    hi = [np.repeat(b.hi, b.fanout, axis=0) for b in blocks]
    empty_lo, empty_hi = boxes.empty(ndim)
    return (
        np.concatenate([*src, none]),
        np.concatenate([*(b.dsts for b in blocks), none]),
        np.concatenate([*lo, empty_lo]),
        np.concatenate([*hi, empty_hi]),
    )


def _disjoint(rects: list[Rect]) -> bool:
    if len(rects) > PAIRWISE:
        return int(CellGrid.of(rects).count(0).max(initial=0)) <= 1
    return all(not a.overlaps(b) for i, a in enumerate(rects) for b in rects[i + 1 :])


def _check_coverage(task: str, space: Rect, pieces: list[Rect]) -> None:
    if any(not space.contains(p) for p in pieces):
        raise VerifyError(f"{task}: a piece lies outside the space {space!r}")
    if not _disjoint(pieces):
        raise VerifyError(f"{task}: two pieces overlap")
    if sum(p.volume for p in pieces) != space.volume:
        raise VerifyError(f"{task}: the pieces do not cover the space {space!r}")


def _check_producers(task: str, tensor: str, reads: list[Rect], sources: list[Rect]) -> None:
    if len(sources) > PAIRWISE:
        grid = CellGrid.of(sources, reads)
        once = grid.volume_where(grid.count(0) == 1, 1)
        bad = [r for r, v in zip(reads, once.tolist()) if v != r.volume]
    else:
        bad = []
        for rect in reads:
            parts = [rect.intersect(r) for r in sources]
            parts = [p for p in parts if not p.is_empty()]
            if not _disjoint(parts) or sum(p.volume for p in parts) != rect.volume:
                bad.append(rect)
    if bad:
        raise VerifyError(
            f"{task}: {bad[0]!r} of {tensor} does not have exactly one producer piece"
        )


def _check_not_again(
    task: str,
    key: tuple[str, int],
    reads: list[Rect],
    read_before: set[Rect],
    received: dict[tuple[str, int], list[Rect]],
) -> None:
    """No part reaches a rank for a rect it read before, since the tensor was last written."""
    if not read_before or not received.get(key) or not any(r in read_before for r in reads):
        return
    fresh = [r for r in reads if r not in read_before]
    for part in received[key]:
        if not any(_inside(part, r) for r in fresh):
            raise VerifyError(f"{task}: rank {key[1]} is sent {part!r} of {key[0]} again")


def _check_messages(
    task: str,
    key: tuple[str, int],
    reads: list[Rect],
    held: list[Rect],
    cached: list[Rect],
    got: list[Rect],
) -> None:
    tensor, rank = key
    for part in got:
        if not any(_inside(part, r) for r in reads):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, unread")
    if not _disjoint(got):
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    for part in got:
        if any(part.overlaps(h) for h in held):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds")
    have = held + cached + got
    for read in reads:
        if not read.covered_by(have):
            raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


#: a rank, and the rects of one tensor that it reads, holds, holds as copies and receives
_RankBoxes = tuple[int, list[Rect], list[Rect], list[Rect], list[Rect]]


def _count_messages(task: str, tensor: str, ranks: list[_RankBoxes]) -> None:
    """`_check_messages` by counting, for ranks with many boxes of `tensor`.

    The ranks share one grid, a layer per rank, cut at every bound of all their boxes: where
    each reads the same wide rect (a transpose, a model-parallel layer's input) that grid is
    about as fine as each rank's own, and one pass replaces a call per rank. Where they read
    apart (a halo each) it is far finer, so past `RANK_CELLS` a cell per rank they are counted
    one by one; past `BATCH_CELLS` in all, half of them at a time."""
    groups = [[rect for boxes_of in ranks for rect in boxes_of[g]] for g in range(1, 5)]
    layer = np.repeat(
        np.tile(np.arange(len(ranks)), 4),
        [len(boxes_of[g]) for g in range(1, 5) for boxes_of in ranks],
    )
    lo, hi = arrays([rect for group in groups for rect in group])
    grid = CellGrid(lo, hi, [len(group) for group in groups], layer, len(ranks))
    if len(ranks) > 1 and grid.size > RANK_CELLS * len(ranks):
        for (rank, *_), alone in zip(ranks, grid.by_layer()):
            _check_counts(task, tensor, [rank], groups, alone)
    elif len(ranks) > 1 and grid.size > BATCH_CELLS:
        _count_messages(task, tensor, ranks[: len(ranks) // 2])
        _count_messages(task, tensor, ranks[len(ranks) // 2 :])
    else:
        _check_counts(task, tensor, [rank for rank, *_ in ranks], groups, grid)


def _check_counts(
    task: str, tensor: str, ranks: list[int], groups: list[list[Rect]], grid: CellGrid
) -> None:
    """The checks of `_count_messages` on `grid`, whose layers are `ranks` and whose groups are
    (some of) the reads, holdings, copies and received parts in `groups`."""
    reads, got = groups[0], groups[3]

    def rank_of(group: int, index: int) -> int:
        return ranks[int(grid.layer(group)[index])]

    unread = np.flatnonzero(~grid.inside_one(3, 0))
    if len(unread):
        part = got[grid.rows[3][unread[0]]]
        raise VerifyError(
            f"{task}: rank {rank_of(3, unread[0])} is sent {part!r} of {tensor}, unread"
        )
    arrived, holds, copied = grid.counts([3, 1, 2])
    twice = np.flatnonzero(arrived.reshape(len(ranks), -1).max(axis=1, initial=0) > 1)
    if len(twice):
        raise VerifyError(f"{task}: rank {ranks[twice[0]]} receives part of {tensor} twice")
    inside = grid.volume_where(holds > 0, 3)
    bad = np.flatnonzero(inside > 0)
    if len(bad):
        rank, part = rank_of(3, bad[0]), got[grid.rows[3][bad[0]]]
        raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds")
    covered = grid.volume_where((arrived + holds + copied) > 0, 0)
    lacking = np.flatnonzero(covered != grid.volumes(0))
    if len(lacking):
        rank, read = rank_of(0, lacking[0]), reads[grid.rows[0][lacking[0]]]
        raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


def _inside(part: Rect, rect: Rect) -> bool:
    """`rect.contains(part)` for a non-empty part, without Rect's checks (called per message)."""
    return all(a <= c and d <= b for a, b, c, d in zip(rect.lo, rect.hi, part.lo, part.hi))
