"""`verify_plan(graph, plan)`: the invariants of a plan, checked by brute force.

The checks recompute from the `Piece` and `Transfer` objects alone, without the layouts the planner
used, so they test the planner rather than restate it:

1. coverage: the pieces of every partitioned task lie in its space, are disjoint and cover it;
2. producers: every element a piece reads of a non-resident tensor was written by exactly one piece
   of the latest earlier task that writes the tensor;
3. messages: what reaches a rank for one task and tensor is disjoint from what it holds and from
   every other part sent to it, lies in a rect the rank reads, and together with what it holds
   (its pieces and the copies it received since the tensor was last written) covers what its
   pieces read.

Small sets of boxes are compared pair by pair. Large ones (a task's pieces, a tensor's writers, the
parts of a transpose arriving at one rank) are counted instead: `_Grid` cuts space at every bound
of the boxes (coordinate compression), counts how many boxes cover each resulting cell with an
N-d difference array, and sums cell volumes over a box with a summed-volume table, so a check costs
about the number of cells rather than the square of the number of boxes.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product

import numpy as np

from legion_nn.errors import VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.plan import Plan

#: boxes beyond which sets are counted on a grid rather than compared pair by pair
PAIRWISE = 24


def verify_plan(graph: TaskGraph, plan: Plan) -> None:
    """Raise `VerifyError` naming the first broken invariant."""
    writers: dict[str, dict[int, list[Rect]]] = {}
    copies: dict[tuple[str, int], list[Rect]] = defaultdict(list)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task_plan.grid is None:
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
            sources = writers.get(tensor)
            if sources is None:
                raise VerifyError(f"{task.name} reads {tensor}, never written before")
            _check_producers(task.name, tensor, rects, [r for rs in sources.values() for r in rs])
        received: dict[tuple[str, int], list[Rect]] = defaultdict(list)
        for transfer in task_plan.transfers:
            if transfer.reduce:
                continue
            for dst in transfer.dsts:
                received[(transfer.tensor, dst)].append(transfer.rect)
        for key in set(needed) | set(received):
            held = writers.get(key[0], {}).get(key[1], [])
            _check_messages(
                task.name, key, needed.get(key, []), held, copies[key], received.get(key, [])
            )
            copies[key].extend(received.get(key, []))
        for req_index, req in enumerate(task.requirements):
            if req.privilege.writes and req.privilege is not Privilege.REDUCE:
                written: dict[int, list[Rect]] = defaultdict(list)
                for p in pieces:
                    rect = p.requirements[req_index].write_rect
                    if not rect.is_empty():
                        written[p.ranks[0]].append(rect)
                writers[req.tensor] = written
                for key in [k for k in copies if k[0] == req.tensor]:
                    del copies[key]


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
        _count_messages(task, key, reads, held + cached, got)
        return
    if not _disjoint(got):
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    for part in got:
        if any(part.overlaps(h) for h in held + cached):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds")
    for read in reads:
        have = [read.intersect(r) for r in held + cached + got]
        if not _covers(read, [h for h in have if not h.is_empty()]):
            raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


def _count_messages(
    task: str, key: tuple[str, int], reads: list[Rect], had: list[Rect], got: list[Rect]
) -> None:
    """`_check_messages` by counting, for many boxes."""
    tensor, rank = key
    grid = _Grid(reads + had + got)
    arrived = grid.count(got) if got else np.zeros(grid.shape, np.int64)
    present = grid.count(had) if had else np.zeros(grid.shape, np.int64)
    if int(arrived.max(initial=0)) > 1:
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    if got:
        for part, volume in zip(got, grid.volume_where(present > 0, got).tolist()):
            if volume:
                raise VerifyError(
                    f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds"
                )
    if reads:
        covered = grid.volume_where((arrived + present) > 0, reads)
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
