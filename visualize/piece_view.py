"""The piece view of a plan: who computes which piece, and what crosses ranks, as plain data.

A *piece node* is one task on one rank: every piece of the task that rank computes (a partitioned
task has at most one per rank; a homed task, such as an update of a replicated parameter, has one
node on every holder of its cells, so a replicated piece appears once per holder). A *collective
node* is one `Reduction` of the plan (an all-reduce, reduce or reduce-scatter, or an all-gather
that brings a task its reads); it belongs to no rank.

Links run in program order. They are read from the plan's record (`Plan.written_by` after each
task, the layouts in `TaskPlan.holdings`), its pieces' rects, transfers and reductions, with no
replay of writes: what a piece on rank r reads of a cell came from the cell's last writer in
view, and from the writers before it as far as the data on r is made of their parts (a partial
sum adds to what r held; a collective's result or a write on r replaces it):

- `local`: a piece reads (or reduces into) a rect a piece of an earlier task wrote or reduced
  into on its own rank (a rank's own contribution to a sum is such a write);
- `transfer`: a `Transfer`, from the piece that produced the rect on the sender (or the
  collective, or the pieces whose partial sums it holds) to the reading piece on each destination
  (one link per destination, each with the bytes it receives);
- `reduce`: a reduce `Transfer`, a partial sum the holder adds into its copy: from the
  contributing piece to the first piece on the holder that then reads the sum (when none in view
  does, to the same task's piece there, or to a node for the tensor);
- `collective`: from each contributing piece into the collective (the bytes of its partial sums
  of the targets), and from the collective to the first piece on each holder that then reads its
  target (the bytes of that holder's targets); for an all-gather, from the piece that produced
  each part on its owner, and to the reading piece on every other rank that receives it. These
  are the bytes the data carries, not the bytes an algorithm puts on the wire (a ring
  all-reduce sends 2(p−1)/p of them per rank).

A partial sum or a collective's result is linked to its first reader on the holder only: later
readers there depend on it through that rank, and link to the holder's own contribution.

A received copy that a later task reads again (the backward pass re-reading the halo its forward
pass fetched) is not linked again: the plan sends it once, and the later piece depends on the
receiving one through its own rank.

`collapse_by_unit` folds the view to two nodes per (unit, rank), its forward tasks and the rest,
and one collective node per unit and algorithm, summing the links between them. `visualize.partition_dot` draws either.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from itertools import count

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.plan import Plan, Transfer
from partitioner.task_plan import Reduction, TaskPlan

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
class _Delivery:
    """A partial sum or a collective's result that `task` delivered to a holder, not yet read."""

    task: int
    #: the order it was sent in
    order: int
    rect: Rect
    #: the node the data comes from: the contributing piece, or the collective
    node: str
    #: the link its first reader gets
    via: Link


def piece_view(graph: TaskGraph, plan: Plan, tasks: set[str] | None = None) -> PieceView:
    """The piece view of `plan` (built for `graph`), limited to the named `tasks` if given."""
    builder = _Builder(plan)
    for index, (task, task_plan) in enumerate(zip(graph.tasks, plan.tasks)):
        if tasks is None or task.name in tasks:
            builder.add(index, task, task_plan)
        builder.advance(index, task_plan)
    return builder.view()


class _Builder:
    """Walks the plan's record task by task: the layout and last writer of each cell before the
    task give the links into its pieces and transfers."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.pieces: dict[str, PieceNode] = {}
        self.collectives: dict[str, CollectiveNode] = {}
        self.links: dict[tuple, Link] = {}
        self.layouts: dict[str, Layout] = dict(plan.homes)
        #: per tensor, `Plan.written_by` after each task since its layout was made
        self.history: dict[str, list[np.ndarray]] = {
            name: [np.full(home.ncells, -1)] for name, home in plan.homes.items()
        }
        #: per task in view, per (rank, tensor), the rects its pieces there write or reduce into
        self.wrote: dict[int, dict[tuple[int, str], list[Rect]]] = {}
        self.pending: dict[tuple[int, str], list[_Delivery]] = defaultdict(list)
        self.sent = count()

    def view(self) -> PieceView:
        for deliveries in self.pending.values():
            for delivery in deliveries:
                if delivery.via.kind == "reduce":
                    self.link(delivery.via)
        return PieceView(self.plan.nranks, self.pieces, self.collectives, list(self.links.values()))

    def advance(self, index: int, task_plan: TaskPlan) -> None:
        for tensor, writers in self.plan.written_by[index].items():
            if task_plan.holdings[tensor] is self.layouts.get(tensor):
                self.history[tensor].append(writers)
            else:
                self.history[tensor] = [writers]
        self.layouts.update(task_plan.holdings)

    def link(self, new: Link) -> None:
        if new.src != new.dst:
            self.links.setdefault((new.src, new.dst, new.kind, new.tensor, new.rect), new)

    def tensor_node(self, tensor: str, rank: int, unit: str) -> str:
        node_id = piece_id(tensor, rank)
        self.pieces.setdefault(node_id, PieceNode(node_id, tensor, rank, "tensor", unit))
        return node_id

    def add(self, index: int, task: Task, task_plan: TaskPlan) -> None:
        wrote: dict[tuple[int, str], list[Rect]] = defaultdict(list)
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                node_id = piece_id(task.name, rank)
                if node_id not in self.pieces:
                    self.pieces[node_id] = PieceNode(
                        node_id, task.name, rank, task.phase, task_plan.unit
                    )
                self.pieces[node_id].rects.append(piece.rect)
                for req in piece.requirements:
                    if req.privilege.writes and req.write_rect is not None:
                        wrote[(rank, req.tensor)].append(req.write_rect)
        self._reads(task, task_plan)
        for transfer in task_plan.transfers:
            if not transfer.reduce:
                self._fetch(task, task_plan, transfer)
        for number, (_, gather) in enumerate(task_plan.gathered):
            self._gather(task, task_plan, number, gather)
        self.wrote[index] = wrote
        for transfer in task_plan.transfers:
            if transfer.reduce:
                self._partial_sum(index, task, task_plan, transfer)
        for number, reduction in enumerate(task_plan.reductions):
            self._collective(index, task, task_plan, number, reduction)

    def _sources(self, rank: int, tensor: str, rect: Rect) -> list[_Delivery | str]:
        """What a reader of `rect` on `rank` gets its data from, newest first: per cell, walking
        back through the cell's writers in view, the unread deliveries each sent `rank` and its
        own piece there, down to one that replaced the data (a collective's result, or a write on
        `rank`). An own piece is its node's id."""
        layout = self.layouts.get(tensor)
        if layout is None:
            return []
        pending = self.pending.get((rank, tensor), ())
        found: dict[object, tuple[tuple[int, int, int], _Delivery | str]] = {}
        for cell, part in layout.cells(rect):
            remaining = [part]
            for writer in self._writers_of(tensor, cell):
                for delivery in pending:
                    if delivery.task == writer and _overlaps(delivery.rect, remaining):
                        found[id(delivery)] = ((writer, 1, delivery.order), delivery)
                        if delivery.via.kind == "collective":
                            remaining = _minus(remaining, delivery.rect)
                for wrote in self.wrote[writer].get((rank, tensor), ()):
                    if _overlaps(wrote, remaining):
                        node = piece_id(self.plan.tasks[writer].task, rank)
                        found[node] = ((writer, 0, 0), node)
                        remaining = _minus(remaining, wrote)
                if not remaining:
                    break
        return [source for _, source in sorted(found.values(), key=lambda f: f[0], reverse=True)]

    def _writers_of(self, tensor: str, cell: int) -> list[int]:
        """The tasks in view that wrote or reduced into `cell` of the tensor's layout, newest
        first (`Plan.written_by` after each task since the layout was made)."""
        out = []
        for writers in reversed(self.history[tensor]):
            writer = int(writers[cell])
            if writer in self.wrote and (not out or out[-1] != writer):
                out.append(writer)
        return out

    def _reads(self, task: Task, task_plan: TaskPlan) -> None:
        """Links into each piece from what it reads (a reduction folds into what is there, so
        it reads too); a delivery is linked to its first reader only."""
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                here = piece_id(task.name, rank)
                for req in piece.requirements:
                    rect = req.write_rect if req.privilege is Privilege.REDUCE else req.read_rect
                    if rect is None or rect.is_empty():
                        continue
                    for source in self._sources(rank, req.tensor, rect):
                        if isinstance(source, _Delivery):
                            self.link(replace(source.via, dst=here))
                            self.pending[(rank, req.tensor)].remove(source)
                        else:
                            self.link(Link(source, here, "local", req.tensor, phase=task.phase))

    def _senders(self, rank: int, tensor: str, rect: Rect, unit: str) -> list[str]:
        """The nodes whose data `rank` sends of `rect`: what it got it from (`_sources`), or
        where nothing in view wrote it there (a resident tensor, or a writer left out), a node
        for the tensor."""
        senders = [
            source.node if isinstance(source, _Delivery) else source
            for source in self._sources(rank, tensor, rect)
        ]
        return senders or [self.tensor_node(tensor, rank, unit)]

    def _collective_node(
        self, task: Task, task_plan: TaskPlan, number: int, reduction: Reduction
    ) -> CollectiveNode:
        node = CollectiveNode(
            f"{reduction.algorithm}/{task.name}#{number}",
            f"{reduction.algorithm} {reduction.tensor}",
            task_plan.unit,
            reduction.algorithm,
            [reduction.tensor],
            reduction.participants,
            reduction.nbytes,
        )
        self.collectives[node.id] = node
        return node

    def _fetch(self, task: Task, task_plan: TaskPlan, transfer: Transfer) -> None:
        senders = self._senders(transfer.src, transfer.tensor, transfer.rect, task_plan.unit)
        for sender in senders:
            for dst in transfer.dsts:
                receiver = piece_id(task.name, dst)
                self.link(_message(sender, receiver, "transfer", transfer, task.phase))

    def _gather(self, task: Task, task_plan: TaskPlan, number: int, gather: Reduction) -> None:
        """An all-gather bringing the task its reads (`TaskPlan.gathered`): from the piece that
        produced each part on its owner into the collective, and from the collective to the
        reading piece on every other rank that receives the part."""
        node = self._collective_node(task, task_plan, number, gather)
        for (rect, holders), owner in zip(gather.targets, gather.owners):
            nbytes = rect.volume * gather.itemsize
            for sender in self._senders(owner, gather.tensor, rect, task_plan.unit):
                self.link(
                    Link(
                        sender, node.id, "collective", gather.tensor, rect, nbytes, phase=task.phase
                    )
                )
            for rank in holders:
                if rank != owner:
                    receiver = piece_id(task.name, rank)
                    self.link(
                        Link(
                            node.id,
                            receiver,
                            "collective",
                            gather.tensor,
                            rect,
                            nbytes,
                            phase=task.phase,
                        )
                    )

    def _partial_sum(self, index: int, task: Task, task_plan: TaskPlan, transfer: Transfer) -> None:
        source = piece_id(task.name, transfer.src)
        for dst in transfer.dsts:
            target = piece_id(task.name, dst)
            if target not in self.pieces:
                target = self.tensor_node(transfer.tensor, dst, task_plan.unit)
            sent = _message(source, target, "reduce", transfer, task.phase)
            self.pending[(dst, transfer.tensor)].append(
                _Delivery(index, next(self.sent), transfer.rect, source, sent)
            )

    def _collective(
        self, index: int, task: Task, task_plan: TaskPlan, number: int, reduction: Reduction
    ) -> None:
        node = self._collective_node(task, task_plan, number, reduction)
        bounds = reduction.targets[0][0]
        for rect, _ in reduction.targets[1:]:
            bounds = bounds.union_bounds(rect)
        for rank in reduction.summed_from:  # its extra participants add nothing
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
                delivery = _Delivery(index, next(self.sent), rect, node.id, result)
                self.pending[(rank, reduction.tensor)].append(delivery)


def _overlaps(rect: Rect, parts: list[Rect]) -> bool:
    return any(part.overlaps(rect) for part in parts)


def _minus(parts: list[Rect], rect: Rect) -> list[Rect]:
    return [rest for part in parts for rest in part.difference(rect)]


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
