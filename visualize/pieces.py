"""The piece view of a plan: who computes which piece, and what crosses ranks, as plain data.

A *piece node* is one task on one rank: every piece of the task that rank computes (a partitioned
task has at most one per rank; a homed task, such as an update of a replicated parameter, has one
node on every holder of its cells, so a replicated piece appears once per holder). A *collective
node* is one `Reduction` of the plan (an all-reduce, reduce or reduce-scatter); it belongs to no
rank.

Links run in program order, found by replaying the plan's writes rank by rank:

- `local`: a piece reads (or reduces into) a rect its own rank last wrote, by an earlier task;
- `transfer`: a `Transfer`, from the piece that last wrote the rect on the sender to the reading
  piece on each destination (one link per destination, each with the bytes it receives);
- `reduce`: a reduce `Transfer`, a partial sum the holder adds into its copy: from the
  contributing piece to the first piece on the holder that then reads the sum (when none in view
  does, to the same task's piece there, or to a node for the tensor);
- `collective`: from each contributing piece into the collective (the bytes of its partial sums
  of the targets), and from the collective to the first piece on each holder that then reads its
  target (the bytes of that holder's targets). These are the bytes the data carries, not the
  bytes an algorithm puts on the wire (a ring all-reduce sends 2(p−1)/p of them per rank).

A received copy that a later task reads again (the backward pass re-reading the halo its forward
pass fetched) is not linked again: the plan sends it once, and the later piece depends on the
receiving one through its own rank.

`collapse_by_unit` folds the view to two nodes per (unit, rank), its forward tasks and the rest,
and one collective node per unit and algorithm, summing the links between them. `visualize.partition_dot` draws either.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.plan import Plan, Reduction, TaskPlan, Transfer

LINK_KINDS = ("local", "transfer", "reduce", "collective")


@dataclass
class PieceNode:
    id: str
    name: str
    rank: int
    phase: str
    unit: str
    rects: list[Rect] = field(default_factory=list)
    #: how many tasks the node stands for (1 unless collapsed)
    tasks: int = 1


@dataclass
class CollectiveNode:
    id: str
    name: str
    unit: str
    algorithm: str
    tensors: list[str]
    participants: tuple[int, ...]
    nbytes: int


@dataclass
class Link:
    src: str
    dst: str
    kind: str
    tensor: str = ""
    rect: Rect | None = None
    nbytes: int = 0
    #: messages a collapsed link stands for
    count: int = 1
    phase: str = ""


@dataclass
class PieceView:
    nranks: int
    pieces: dict[str, PieceNode]
    collectives: dict[str, CollectiveNode]
    links: list[Link]

    def ranks_used(self) -> list[int]:
        return sorted({node.rank for node in self.pieces.values()})

    def node_count(self) -> int:
        return len(self.pieces) + len(self.collectives)

    def cross_links(self) -> list[Link]:
        return [link for link in self.links if link.kind != "local"]


def ranks_text(ranks: tuple[int, ...]) -> str:
    """`3`, `0–3`, `0,2,5`."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return ",".join(map(str, ranks))


def piece_id(name: str, rank: int) -> str:
    return f"{name}@r{rank}"


@dataclass
class _Written:
    rect: Rect
    node: str
    #: for data from another rank (a collective's result, a partial sum), the link its first
    #: reader gets; None for the rank's own writes
    via: Link | None = None
    #: whether it replaces what was there (a partial sum adds to it)
    covers: bool = True


class _Replay:
    """Per rank and tensor, the latest writers of each part, in program order."""

    def __init__(self) -> None:
        self.written: dict[tuple[int, str], list[_Written]] = defaultdict(list)

    def record(self, rank: int, tensor: str, entry: _Written) -> None:
        self.written[(rank, tensor)].append(entry)

    def writers(self, rank: int, tensor: str, rect: Rect) -> list[_Written]:
        """The latest entries that wrote some part of `rect` on `rank`, newest first."""
        remaining = [rect]
        found = []
        for entry in reversed(self.written.get((rank, tensor), ())):
            if not remaining:
                break
            if any(part.overlaps(entry.rect) for part in remaining):
                found.append(entry)
                if entry.covers:
                    remaining = [rest for part in remaining for rest in part.difference(entry.rect)]
        return found

    def consume(self, rank: int, tensor: str, entry: _Written) -> None:
        """Data from another rank is linked to its first reader only."""
        self.written[(rank, tensor)].remove(entry)

    def unread(self) -> list[Link]:
        """Partial sums that no piece in view read: linked to where they were sent."""
        return [
            entry.via
            for entries in self.written.values()
            for entry in entries
            if entry.via is not None and entry.via.kind == "reduce"
        ]


def piece_view(graph: TaskGraph, plan: Plan, tasks: set[str] | None = None) -> PieceView:
    """The piece view of `plan` (built for `graph`), limited to the named `tasks` if given."""
    builder = _Builder()
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if tasks is None or task.name in tasks:
            builder.add(task, task_plan)
    return builder.view(plan.nranks)


class _Builder:
    """Replays a plan task by task: reads, fetches, writes, partial sums, then collectives."""

    def __init__(self) -> None:
        self.pieces: dict[str, PieceNode] = {}
        self.collectives: dict[str, CollectiveNode] = {}
        self.links: dict[tuple, Link] = {}
        self.replay = _Replay()

    def view(self, nranks: int) -> PieceView:
        for unread in self.replay.unread():
            self.link(unread)
        return PieceView(nranks, self.pieces, self.collectives, list(self.links.values()))

    def link(self, new: Link) -> None:
        if new.src != new.dst:
            self.links.setdefault((new.src, new.dst, new.kind, new.tensor, new.rect), new)

    def tensor_node(self, tensor: str, rank: int, unit: str) -> str:
        node_id = piece_id(tensor, rank)
        self.pieces.setdefault(node_id, PieceNode(node_id, tensor, rank, "tensor", unit))
        return node_id

    def add(self, task: Task, task_plan: TaskPlan) -> None:
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                node_id = piece_id(task.name, rank)
                if node_id not in self.pieces:
                    self.pieces[node_id] = PieceNode(
                        node_id, task.name, rank, task.phase, task_plan.unit
                    )
                self.pieces[node_id].rects.append(piece.rect)
        self._reads(task, task_plan)
        for transfer in task_plan.transfers:
            if not transfer.reduce:
                self._fetch(task, task_plan, transfer)
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                for req in piece.requirements:
                    if req.privilege.writes and req.write_rect is not None:
                        entry = _Written(req.write_rect, piece_id(task.name, rank))
                        self.replay.record(rank, req.tensor, entry)
        # Partial sums come after the task's own writes: they add to what it wrote.
        for transfer in task_plan.transfers:
            if transfer.reduce:
                self._partial_sum(task, task_plan, transfer)
        for index, reduction in enumerate(task_plan.reductions):
            self._collective(task, task_plan, index, reduction)

    def _reads(self, task: Task, task_plan: TaskPlan) -> None:
        """Links into each piece from what it reads (a reduction folds into what is there, so
        it reads too)."""
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                here = piece_id(task.name, rank)
                for req in piece.requirements:
                    rect = req.write_rect if req.privilege is Privilege.REDUCE else req.read_rect
                    if rect is None or rect.is_empty():
                        continue
                    for entry in self.replay.writers(rank, req.tensor, rect):
                        if entry.via is None:
                            self.link(Link(entry.node, here, "local", req.tensor, phase=task.phase))
                            continue
                        self.link(replace(entry.via, dst=here))
                        self.replay.consume(rank, req.tensor, entry)

    def _fetch(self, task: Task, task_plan: TaskPlan, transfer: Transfer) -> None:
        senders = [
            entry.node
            for entry in self.replay.writers(transfer.src, transfer.tensor, transfer.rect)
        ]
        if not senders:
            # Nothing in view wrote it there (a resident tensor, or a writer left out).
            senders = [self.tensor_node(transfer.tensor, transfer.src, task_plan.unit)]
        for sender in senders:
            for dst in transfer.dsts:
                receiver = piece_id(task.name, dst)
                self.link(_message(sender, receiver, "transfer", transfer, task.phase))

    def _partial_sum(self, task: Task, task_plan: TaskPlan, transfer: Transfer) -> None:
        source = piece_id(task.name, transfer.src)
        for dst in transfer.dsts:
            target = piece_id(task.name, dst)
            if target not in self.pieces:
                target = self.tensor_node(transfer.tensor, dst, task_plan.unit)
            sent = _message(source, target, "reduce", transfer, task.phase)
            entry = _Written(transfer.rect, source, sent, covers=False)
            self.replay.record(dst, transfer.tensor, entry)

    def _collective(
        self, task: Task, task_plan: TaskPlan, index: int, reduction: Reduction
    ) -> None:
        node = CollectiveNode(
            f"{reduction.algorithm}/{task.name}#{index}",
            f"{reduction.algorithm} {reduction.tensor}",
            task_plan.unit,
            reduction.algorithm,
            [reduction.tensor],
            reduction.participants,
            reduction.nbytes,
        )
        self.collectives[node.id] = node
        bounds = reduction.targets[0][0]
        for rect, _ in reduction.targets[1:]:
            bounds = bounds.union_bounds(rect)
        for rank in reduction.participants:
            source = piece_id(task.name, rank)
            if source in self.pieces:
                self.link(
                    Link(
                        source,
                        node.id,
                        "collective",
                        reduction.tensor,
                        bounds,
                        reduction.nbytes,
                        phase=task.phase,
                    )
                )
        for rect, holders in reduction.targets:
            nbytes = rect.volume * reduction.itemsize
            result = Link(
                node.id, "", "collective", reduction.tensor, rect, nbytes, phase=task.phase
            )
            for rank in holders:
                self.replay.record(rank, reduction.tensor, _Written(rect, node.id, result))


def _message(src: str, dst: str, kind: str, transfer: Transfer, phase: str) -> Link:
    return Link(src, dst, kind, transfer.tensor, transfer.rect, transfer.nbytes, phase=phase)


def collapse_by_unit(view: PieceView) -> PieceView:
    """Per rank, one node for a unit's forward tasks and one for the rest of its tasks (backward,
    update, zeroing), so that links still run in program order; one collective per (unit,
    algorithm, participants); links between different nodes summed by kind and phase."""
    group: dict[str, str] = {}
    pieces: dict[str, PieceNode] = {}
    for node in view.pieces.values():
        phase = "forward" if node.phase == "forward" else "backward"
        node_id = piece_id(f"{node.unit}.{phase}", node.rank)
        group[node.id] = node_id
        merged = pieces.get(node_id)
        if merged is None:
            merged = PieceNode(node_id, node.unit, node.rank, phase, node.unit, [], 0)
            pieces[node_id] = merged
        merged.tasks += 1
        merged.rects.extend(node.rects)
    collectives: dict[str, CollectiveNode] = {}
    for node in view.collectives.values():
        node_id = f"{node.algorithm}/{node.unit}/" + ",".join(map(str, node.participants))
        group[node.id] = node_id
        merged = collectives.get(node_id)
        if merged is None:
            collectives[node_id] = CollectiveNode(
                node_id,
                f"{node.algorithm} ({node.unit})",
                node.unit,
                node.algorithm,
                [],
                node.participants,
                0,
            )
            merged = collectives[node_id]
        merged.tensors.extend(node.tensors)
        merged.nbytes += node.nbytes
    sums: dict[tuple[str, str, str, str], Link] = {}
    for old in view.links:
        src, dst = group[old.src], group[old.dst]
        if src == dst:
            continue
        key = (src, dst, old.kind, old.phase)
        new = sums.get(key)
        if new is None:
            sums[key] = Link(
                src, dst, old.kind, old.tensor, old.rect, old.nbytes, old.count, old.phase
            )
            continue
        new.nbytes += old.nbytes
        new.count += old.count
        if new.tensor != old.tensor or new.rect != old.rect:
            new.tensor, new.rect = "", None
    return PieceView(view.nranks, pieces, collectives, list(sums.values()))
