"""`verify_plan(graph, plan)`: the invariants of a plan, checked by brute force.

The checks recompute from the pieces alone, without the layouts the planner used, so they test the
planner rather than restate it. They scan all pairs of pieces: meant for tests and small rank
counts, not for planning 1024 ranks.

1. coverage: the pieces of every partitioned task lie in its space, are disjoint and cover it;
2. producers: every element a piece reads of a non-resident tensor was written by exactly one piece
   of the latest earlier task that writes the tensor;
3. messages: what reaches a rank for one task and tensor is disjoint from what it holds and from
   every other part sent to it, and together with what it holds (its pieces and the copies it
   received since the tensor was last written) covers what its pieces read.
"""

from __future__ import annotations

from collections import defaultdict

from legion_nn.errors import VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.plan import Plan


def verify_plan(graph: TaskGraph, plan: Plan) -> None:
    """Raise `VerifyError` naming the first broken invariant."""
    writers: dict[str, list[tuple[int, Rect]]] = {}
    copies: dict[tuple[str, int], list[Rect]] = defaultdict(list)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task_plan.grid is None:
            continue
        _check_coverage(task.name, task.space, [p.rect for p in task_plan.pieces])
        needed: dict[tuple[str, int], list[Rect]] = defaultdict(list)
        for piece in task_plan.pieces:
            for req in piece.requirements:
                if not req.privilege.reads or req.read_rect is None or req.read_rect.is_empty():
                    continue
                if graph.tensors[req.tensor].resident:
                    continue
                sources = writers.get(req.tensor)
                if sources is None:
                    raise VerifyError(f"{task.name} reads {req.tensor}, never written before")
                _check_producers(task.name, req.tensor, req.read_rect, sources)
                needed[(req.tensor, piece.ranks[0])].append(req.read_rect)
        received: dict[tuple[str, int], list[Rect]] = defaultdict(list)
        for transfer in task_plan.transfers:
            if transfer.reduce:
                continue
            for dst in transfer.dsts:
                received[(transfer.tensor, dst)].append(transfer.rect)
        for key in set(needed) | set(received):
            held = [r for rank, r in writers.get(key[0], ()) if rank == key[1]]
            _check_messages(
                task.name, key, needed.get(key, []), held, copies[key], received.get(key, [])
            )
            copies[key].extend(received.get(key, []))
        for req_index, req in enumerate(task.requirements):
            if req.privilege.writes and req.privilege is not Privilege.REDUCE:
                writers[req.tensor] = [
                    (p.ranks[0], p.requirements[req_index].write_rect) for p in task_plan.pieces
                ]
                for key in [k for k in copies if k[0] == req.tensor]:
                    del copies[key]


def _disjoint(rects: list[Rect]) -> bool:
    return all(not a.overlaps(b) for i, a in enumerate(rects) for b in rects[i + 1 :])


def _check_coverage(task: str, space: Rect, pieces: list[Rect]) -> None:
    if any(not space.contains(p) for p in pieces):
        raise VerifyError(f"{task}: a piece lies outside the space {space!r}")
    if not _disjoint(pieces):
        raise VerifyError(f"{task}: two pieces overlap")
    if sum(p.volume for p in pieces) != space.volume:
        raise VerifyError(f"{task}: the pieces do not cover the space {space!r}")


def _check_producers(task: str, tensor: str, rect: Rect, sources: list[tuple[int, Rect]]) -> None:
    parts = [rect.intersect(r) for _, r in sources]
    parts = [p for p in parts if not p.is_empty()]
    if not _disjoint(parts) or sum(p.volume for p in parts) != rect.volume:
        raise VerifyError(f"{task}: {rect!r} of {tensor} does not have exactly one producer piece")


def _check_messages(
    task: str,
    key: tuple[str, int],
    reads: list[Rect],
    held: list[Rect],
    cached: list[Rect],
    got: list[Rect],
) -> None:
    tensor, rank = key
    if not _disjoint(got):
        raise VerifyError(f"{task}: rank {rank} receives part of {tensor} twice")
    for part in got:
        if any(part.overlaps(h) for h in held + cached):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, which it holds")
        if not any(r.contains(part) for r in reads):
            raise VerifyError(f"{task}: rank {rank} is sent {part!r} of {tensor}, unread")
    for read in reads:
        have = [read.intersect(r) for r in held + cached + got]
        if not _covers(read, [h for h in have if not h.is_empty()]):
            raise VerifyError(f"{task}: rank {rank} lacks part of {read!r} of {tensor}")


def _covers(rect: Rect, parts: list[Rect]) -> bool:
    """Whether the union of `parts` contains `rect` (parts may overlap)."""
    remaining = [rect]
    for part in parts:
        remaining = [piece for r in remaining for piece in r.difference(part)]
    return not remaining
