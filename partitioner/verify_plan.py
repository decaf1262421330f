"""`verify_plan(graph, plan)`: the invariants of a plan, checked by brute force.

The checks recompute from the `Piece` and `Transfer` objects alone, without the layouts the planner
used, so they test the planner rather than restate it:

1. coverage: the pieces of every partitioned task lie in its space, are disjoint and cover it;
2. producers: every element a piece reads of a non-resident tensor was written by exactly one piece
   of the latest earlier task that writes the tensor (a homed task's piece, such as the zeroing
   of a parameter's gradient, is run by every holder of its cell, and each holds it);
3. messages: what reaches a rank for one task and tensor is disjoint from what it holds and from
   every other part sent to it, lies in a rect the rank reads, is not wholly a copy it received
   since the tensor was last written, and together with what it holds and those copies covers
   what its pieces read. (A part may overlap such a copy: the planner keeps copies by read rect,
   so a task reading a wider rect than an earlier reader fetches each cell's part whole.)
4. sums: where a partitioned task later reads a tensor that tasks reduce into, every part of
   every piece's contribution reaches every rank holding that part, by the rank's own piece, a
   partial sum sent to it, or a collective that both take part in and whose target the holder
   holds (a sum held by several ranks, such as BatchNorm's parameter gradients read by its
   input gradient, is complete on each).

Small sets of boxes are compared pair by pair. Large ones (a task's pieces, a tensor's writers, the
parts of a transpose arriving at one rank) are counted instead: `_Grid` cuts space at every bound
of the boxes (coordinate compression), counts how many boxes cover each resulting cell with an
N-d difference array, and sums cell volumes over a box with a summed-volume table, so a check costs
about the number of cells rather than the square of the number of boxes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import product

import numpy as np

from legion_nn.errors import VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.plan import Piece, Plan, TaskPlan

#: boxes beyond which sets are counted on a grid rather than compared pair by pair
PAIRWISE = 24


def verify_plan(graph: TaskGraph, plan: Plan) -> None:
    """Raise `VerifyError` naming the first broken invariant."""
    #: per tensor, the rects of the pieces of its latest writer, and per rank those it holds
    writers: dict[str, tuple[list[Rect], dict[int, list[Rect]]]] = {}
    copies: dict[tuple[str, int], list[Rect]] = defaultdict(list)
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
                if graph.tensors[req.tensor].resident:
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
        for key in set(needed) | set(received):
            held = writers[key[0]][1].get(key[1], []) if key[0] in writers else []
            _check_messages(
                task.name, key, needed.get(key, []), held, copies[key], received.get(key, [])
            )
            copies[key].extend(received.get(key, []))
        for tensor in {r.tensor for r in task.requirements if r.privilege is Privilege.REDUCE}:
            if tensor in read and tensor in writers:
                _check_sums(task.name, tensor, task_plan, writers[tensor][1])
        _record_writes(graph, task, pieces, writers, copies)


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
    copies: dict[tuple[str, int], list[Rect]],
) -> None:
    """A task's writes replace what is held of each tensor it writes: every rank of a piece
    holds the piece's rect (a homed piece is run, and held, by every holder of its cell)."""
    for req_index, req in enumerate(task.requirements):
        if not req.privilege.writes or req.privilege is Privilege.REDUCE:
            continue
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


def _check_sums(task: str, tensor: str, task_plan: TaskPlan, held: dict[int, list[Rect]]) -> None:
    """Every part of every piece's contribution to `tensor` reaches every rank holding that
    part: the rank itself, a partial sum sent to the holder, or a collective both take part in
    whose target the holder holds."""
    sent: dict[tuple[int, int], list[Rect]] = defaultdict(list)
    for transfer in task_plan.transfers:
        if transfer.reduce and transfer.tensor == tensor:
            for dst in transfer.dsts:
                sent[(transfer.src, dst)].append(transfer.rect)
    summed: dict[int, list[tuple[frozenset[int], Rect]]] = defaultdict(list)
    for reduction in task_plan.reductions:
        if reduction.tensor == tensor:
            members = frozenset(reduction.participants)
            for rect, holders in reduction.targets:
                for holder in holders:
                    summed[holder].append((members, rect))
    for piece in task_plan.pieces:
        for req in piece.requirements:
            if req.tensor != tensor or req.privilege is not Privilege.REDUCE:
                continue
            source = piece.ranks[0]
            for holder, rects in held.items():
                if holder == source:
                    continue
                arrived = sent.get((source, holder), []) + [
                    rect for members, rect in summed.get(holder, []) if source in members
                ]
                for rect in rects:
                    part = req.write_rect.intersect(rect)
                    if not part.is_empty() and not part.covered_by(arrived):
                        raise VerifyError(
                            f"{task}: rank {source}'s partial sum of {part!r} of {tensor} "
                            f"never reaches rank {holder}, which holds it"
                        )


class _Grid:
    """The grid cut at every bound of some boxes: cell i along dim d is [cuts[d][i],
    cuts[d][i + 1]); the last index along each dim is the outside beyond the last cut."""

    def __init__(self, boxes: list[Rect]) -> None:
        lo, hi = _arrays(boxes)
        self.ndim = lo.shape[1]
        self.cuts = [np.unique(np.concatenate((lo[:, d], hi[:, d]))) for d in range(self.ndim)]
        self.shape = tuple(len(c) for c in self.cuts)
        self.volume = np.ones(self.shape, np.int64)
        for d, c in enumerate(self.cuts):
            size = np.append(np.diff(c), 0)
            self.volume = self.volume * size.reshape(
                [-1 if e == d else 1 for e in range(self.ndim)]
            )

    def _corners(self, boxes: list[Rect]):
        lo, hi = _arrays(boxes)
        keep = np.all(hi > lo, axis=1)
        lo = [np.searchsorted(c, lo[keep, d]) for d, c in enumerate(self.cuts)]
        hi = [np.searchsorted(c, hi[keep, d]) for d, c in enumerate(self.cuts)]
        for corner in product((0, 1), repeat=self.ndim):
            index = tuple(hi[d] if up else lo[d] for d, up in enumerate(corner))
            yield index, -1 if sum(corner) % 2 else 1

    def count(self, boxes: list[Rect]) -> np.ndarray:
        """How many of `boxes` (bounds among the cuts) cover each cell (an N-d difference array)."""
        count = np.zeros(self.shape, np.int64)
        for index, sign in self._corners(boxes):
            np.add.at(count, index, sign)
        for axis in range(self.ndim):
            np.cumsum(count, axis=axis, out=count)
        return count

    def volume_where(self, mask: np.ndarray, rects: list[Rect]) -> np.ndarray:
        """For each rect (bounds among the cuts), the volume of its cells where `mask` holds."""
        table = np.pad(np.where(mask, self.volume, 0), [(1, 0)] * self.ndim)
        for axis in range(self.ndim):
            np.cumsum(table, axis=axis, out=table)
        out = np.zeros(len(rects), np.int64)
        for index, sign in self._corners(rects):
            out += table[index] * (sign if self.ndim % 2 == 0 else -sign)
        return out


def _arrays(rects: list[Rect]) -> tuple[np.ndarray, np.ndarray]:
    ndim = rects[0].ndim
    lo = np.array([r.lo for r in rects], np.int64).reshape(len(rects), ndim)
    hi = np.array([r.hi for r in rects], np.int64).reshape(len(rects), ndim)
    return lo, hi


def _disjoint(rects: list[Rect]) -> bool:
    if len(rects) > PAIRWISE:
        return int(_Grid(rects).count(rects).max(initial=0)) <= 1
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
        grid = _Grid(sources + reads)
        once = grid.volume_where(grid.count(sources) == 1, reads)
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
    if len(got) + len(held) + len(cached) > PAIRWISE:
        _count_messages(task, key, reads, held, cached, got)
        return
    if not _disjoint(got):
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    for part in got:
        if any(part.overlaps(h) for h in held):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds")
        if part.covered_by(cached):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor} again")
    for read in reads:
        have = [read.intersect(r) for r in held + cached + got]
        if not _covers(read, [h for h in have if not h.is_empty()]):
            raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


def _count_messages(
    task: str,
    key: tuple[str, int],
    reads: list[Rect],
    held: list[Rect],
    cached: list[Rect],
    got: list[Rect],
) -> None:
    """`_check_messages` by counting, for many boxes."""
    tensor, rank = key
    grid = _Grid(reads + held + cached + got)
    none = np.zeros(grid.shape, np.int64)
    arrived = grid.count(got) if got else none
    holds = grid.count(held) if held else none
    copied = grid.count(cached) if cached else none
    if int(arrived.max(initial=0)) > 1:
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    if got:
        inside = grid.volume_where(holds > 0, got).tolist()
        again = grid.volume_where(copied > 0, got).tolist()
        for part, held_volume, copied_volume in zip(got, inside, again):
            if held_volume:
                raise VerifyError(
                    f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds"
                )
            if copied_volume == part.volume:
                raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor} again")
    if reads:
        covered = grid.volume_where((arrived + holds + copied) > 0, reads)
        for read, volume in zip(reads, covered.tolist()):
            if volume != read.volume:
                raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


def _inside(part: Rect, rect: Rect) -> bool:
    """`rect.contains(part)` for a non-empty part, without Rect's checks (called per message)."""
    return all(a <= c and d <= b for a, b, c, d in zip(rect.lo, rect.hi, part.lo, part.hi))


def _covers(rect: Rect, parts: list[Rect]) -> bool:
    """Whether the union of `parts` contains `rect` (parts may overlap)."""
    remaining = [rect]
    for part in parts:
        remaining = [piece for r in remaining for piece in r.difference(part)]
    return not remaining
