"""Plans: from a task graph, a strategy and R ranks, who computes what and what moves where.

The plan walks the graph in program order and keeps, per tensor, the layout of its valid copies
(`layout.py`). For each task:

1. *pieces*: a partitioned task's grid cells, piece i on rank i, each with the rects it reads,
   writes and reduces into, from the layers' access maps (halos included). A homed task (data
   loading, parameter updates, zeroing parameter gradients) has one piece per cell of its tensors'
   home, run by every holder of the cell.
2. *transfers in*: for every rect a piece reads, the parts held on another rank. Pieces with the
   same read rect share one transfer per cell, sent from the cell's holder to all of them (a
   multicast; the bytes count once per destination). A part is never sent to a rank that holds it,
   and each part of a read rect comes from exactly one cell, so no element reaches a rank twice for
   the same use. A copy received stays valid until the tensor is written again, so a backward
   task reading the halo its forward task fetched gets no second transfer.
3. *writes*: the written rects become the tensor's new layout (one holder per cell).
4. *reductions*: contributions to a reduction target are combined into the target's current
   layout (set by its `set_zero`, which runs on the grid of the activation's producer, or on the
   home of a parameter). Per cell of the target: if every contribution covers the same part and
   more than two ranks take part, a collective; otherwise point-to-point partial sums (`reduce`
   transfers, e.g. the halos of a spatially split input gradient) sent to the holders. Collectives
   over the same participants are merged: `allreduce` when every participant holds every target
   (replicated parameter gradients: ring, 2(p−1)/p·bytes per rank), `reduce_scatter` when each
   target has one owner among several (a `linear` split over its features reducing its input
   gradient), `reduce` when there is one owner (the loss, evaluate's sums, to rank 0).

Resident tensors live where they are read: the home of data and of a parameter holds, on each
rank, exactly the rects that rank's pieces read (an untied weight set under a spatial split lives
with its output positions; a parameter read whole by every batch piece is replicated). Its gradient
and optimizer state share its home; its update runs on every holder, each on its own copy. Reading
resident data is therefore free (the loader loads each rank's halo); the price of a replicated
parameter is the all-reduce of its gradient and the memory of its copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from legion_nn.access import piece_requirements, with_rect
from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.strategy import Grid, Strategy, find_units, is_homed, param_of


class PlanError(LegionNNError):
    """A strategy that cannot be planned (overlapping writes, a read of unwritten data)."""


@dataclass(frozen=True)
class Piece:
    """A rect of a task's space, computed by `ranks` (one rank unless homed and replicated)."""

    ranks: tuple[int, ...]
    rect: Rect
    requirements: tuple[Requirement, ...]


@dataclass(frozen=True)
class Transfer:
    """`rect` of `tensor` sent from `src` to each of `dsts`; `nbytes` per destination.

    A `reduce` transfer carries a partial sum that the destination adds into its copy."""

    tensor: str
    rect: Rect
    src: int
    dsts: tuple[int, ...]
    nbytes: int
    reduce: bool = False


@dataclass(frozen=True)
class Reduction:
    """A collective combining partial sums of `targets` (rect, holders after) over `participants`."""

    tensor: str
    algorithm: str
    participants: tuple[int, ...]
    targets: tuple[tuple[Rect, tuple[int, ...]], ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return sum(rect.volume for rect, _ in self.targets) * self.itemsize


@dataclass
class TaskPlan:
    task: str
    unit: str
    grid: Grid | None
    pieces: list[Piece]
    transfers: list[Transfer] = field(default_factory=list)
    reductions: list[Reduction] = field(default_factory=list)


@dataclass
class Plan:
    network: str
    batch: int
    nranks: int
    strategy: str
    unit_grids: dict[str, Grid]
    tasks: list[TaskPlan]
    layouts: dict[str, Layout]
    homes: dict[str, Layout]


def build_plan(
    graph: TaskGraph,
    strategy: Strategy,
    nranks: int,
    resident_homes: Mapping[str, Layout] | None = None,
) -> Plan:
    """The plan of one training step of `graph` under `strategy` on `nranks` ranks.

    `resident_homes` fixes the homes of parameters and state (and their gradients), for instance
    to those of the full-batch step while planning a run's smaller last batch, so that every rank
    keeps updating the copies it holds."""
    grids = strategy.task_grids(graph)
    for name, grid in grids.items():
        used = 1
        for parts in grid:
            used *= parts
        if used > nranks:
            raise PlanError(f"task {name}: grid {list(grid)} needs {used} ranks, only {nranks}")
    pieces = {
        task.name: _grid_pieces(graph, task, grids[task.name])
        for task in graph.tasks
        if not is_homed(graph, task)
    }
    homes = _homes(graph, pieces)
    if resident_homes:
        homes.update((name, home) for name, home in resident_homes.items() if name in homes)
    units = _task_units(graph)
    layouts: dict[str, Layout] = dict(homes)
    copies: dict[tuple[str, Rect, Layout | None], set[int]] = defaultdict(set)
    plans = []
    for task in graph.tasks:
        if is_homed(graph, task):
            plan = TaskPlan(task.name, units[task.name], None, _homed_pieces(graph, task, homes))
        else:
            plan = TaskPlan(task.name, units[task.name], grids[task.name], pieces[task.name])
            _plan_partitioned(graph, task, plan, layouts, copies)
        plans.append(plan)
    return Plan(
        graph.network,
        graph.batch,
        nranks,
        strategy.name,
        dict(strategy.unit_grids),
        plans,
        layouts,
        homes,
    )


def _grid_pieces(graph: TaskGraph, task: Task, grid: Grid) -> list[Piece]:
    out = []
    for rank, rect in enumerate(task.space.split(grid)):
        if not rect.is_empty():
            out.append(Piece((rank,), rect, piece_requirements(task, graph.tensors, rect)))
    return out


def _homes(graph: TaskGraph, pieces: Mapping[str, list[Piece]]) -> dict[str, Layout]:
    readers: dict[str, list[tuple[int, Rect]]] = defaultdict(list)
    for task in graph.tasks:
        for piece in pieces.get(task.name, ()):
            for req in piece.requirements:
                if req.read_rect is not None and graph.tensors[req.tensor].resident:
                    readers[req.tensor].append((piece.ranks[0], req.read_rect))
    homes = {}
    for name, tensor in graph.tensors.items():
        if tensor.kind in ("data", "param"):
            found = readers.get(name) or [(0, tensor.rect)]
            homes[name] = Layout.from_pieces(len(tensor.dims), found)
    for name in graph.tensors:
        owner = param_of(graph, name)
        if owner is not None and name not in homes:
            homes[name] = homes[owner]
    return homes


def _task_units(graph: TaskGraph) -> dict[str, str]:
    """The table row of every task: its unit, or for helpers the unit of the task they serve."""
    out: dict[str, str] = {}
    for unit in find_units(graph):
        for name in unit.forward + unit.backward:
            out[name] = unit.name
    pending: list[Task] = []
    for task in graph.tasks:
        if task.op == "data":
            out[task.name] = "data"
        elif task.name not in out:
            pending.append(task)
    for task in pending:
        tensors = {r.tensor for r in task.requirements}
        owner = param_of(graph, task.requirements[0].tensor)
        if owner is not None:
            tensors.add(owner)
        out[task.name] = next(
            (
                out[t.name]
                for t in graph.tasks
                if t.name in out
                and t.op != "data"
                and t.op != "update"
                and t.op != "set_zero"
                and tensors & {r.tensor for r in t.requirements}
            ),
            task.layer or task.name,
        )
    return out


def _homed_pieces(graph: TaskGraph, task: Task, homes: Mapping[str, Layout]) -> list[Piece]:
    """One piece per home cell the task touches, run by every holder of the cell."""
    out = []
    if task.op == "data":
        for req in task.requirements:
            for part, holders in homes[req.tensor].held(req.rect):
                if holders:
                    out.append(Piece(holders, part, (with_rect(req, part),)))
        return out
    home = homes[task.requirements[0].tensor]
    for part, holders in home.held(task.space):
        if holders:
            requirements = tuple(with_rect(req, part) for req in task.requirements)
            out.append(Piece(holders, part, requirements))
    return out


def _plan_partitioned(
    graph: TaskGraph,
    task: Task,
    plan: TaskPlan,
    layouts: dict[str, Layout],
    copies: dict[tuple[str, Rect, Layout | None], set[int]],
) -> None:
    reads: dict[tuple[str, Rect], list[int]] = defaultdict(list)
    writes: dict[str, list[tuple[int, Rect]]] = defaultdict(list)
    reduces: dict[tuple[str, Rect], list[int]] = defaultdict(list)
    for piece in plan.pieces:
        rank = piece.ranks[0]
        for req in piece.requirements:
            if req.privilege.reads and req.read_rect is not None and not req.read_rect.is_empty():
                reads[(req.tensor, req.read_rect)].append(rank)
            if req.privilege is Privilege.REDUCE:
                if not req.write_rect.is_empty():
                    reduces[(req.tensor, req.write_rect)].append(rank)
            elif req.privilege.writes:
                writes[req.tensor].append((rank, req.write_rect))
    for (tensor, rect), ranks in reads.items():
        have = copies[(tensor, rect, layouts.get(tensor))]
        fresh = [r for r in ranks if r not in have]
        plan.transfers.extend(_fetch(graph, task, tensor, rect, fresh, layouts))
        have.update(fresh)
    for tensor, pieces in writes.items():
        layout = Layout.from_pieces(len(graph.tensors[tensor].dims), pieces)
        for holders in layout.holders.values():
            if len(holders) > 1:
                raise PlanError(
                    f"task {task.name}: ranks {list(holders)} write overlapping rects of {tensor}"
                )
        layouts[tensor] = layout
    by_tensor: dict[str, list[tuple[Rect, list[int]]]] = defaultdict(list)
    for (tensor, rect), ranks in reduces.items():
        by_tensor[tensor].append((rect, ranks))
    for tensor, contributions in by_tensor.items():
        if tensor not in layouts:
            raise PlanError(f"task {task.name} reduces into {tensor}, which was never zeroed")
        transfers, reductions = _combine(graph, task, tensor, contributions, layouts[tensor])
        plan.transfers.extend(transfers)
        plan.reductions.extend(reductions)


def _fetch(
    graph: TaskGraph,
    task: Task,
    tensor: str,
    rect: Rect,
    readers: list[int],
    layouts: Mapping[str, Layout],
) -> list[Transfer]:
    layout = layouts.get(tensor)
    if layout is None:
        raise PlanError(f"task {task.name} reads {tensor}, which no earlier task wrote")
    itemsize = graph.tensors[tensor].itemsize
    out = []
    covered = 0
    for part, holders in layout.held(rect):
        if not holders:
            raise PlanError(f"task {task.name} reads {part!r} of {tensor}, which nobody holds")
        covered += part.volume
        dsts = tuple(r for r in readers if r not in holders)
        if dsts:
            src = holders[dsts[0] % len(holders)]
            out.append(Transfer(tensor, part, src, dsts, part.volume * itemsize))
    if covered != rect.volume:
        raise PlanError(f"task {task.name} reads {rect!r} of {tensor}; only part of it was written")
    return out


def _combine(
    graph: TaskGraph,
    task: Task,
    tensor: str,
    contributions: list[tuple[Rect, list[int]]],
    layout: Layout,
) -> tuple[list[Transfer], list[Reduction]]:
    itemsize = graph.tensors[tensor].itemsize
    per_cell: dict[int, list[tuple[Rect, list[int]]]] = defaultdict(list)
    for rect, ranks in contributions:
        for index, part in layout.cells(rect):
            per_cell[index].append((part, ranks))
    transfers: list[Transfer] = []
    collectives: dict[tuple[int, ...], list[tuple[Rect, tuple[int, ...]]]] = defaultdict(list)
    participants_cache: dict[tuple, tuple[int, ...]] = {}
    for index, entries in per_cell.items():
        holders = layout.holders.get(index, ())
        if not holders:
            raise PlanError(f"task {task.name} reduces into {tensor} where nothing was zeroed")
        part = entries[0][0]
        if all(p == part for p, _ in entries):
            key = (tuple(id(r) for _, r in entries), holders)
            participants = participants_cache.get(key)
            if participants is None:
                found = set(holders)
                for _, ranks in entries:
                    found.update(ranks)
                participants = participants_cache[key] = tuple(sorted(found))
            if len(participants) == 1:
                continue
            if len(participants) == 2 and len(holders) == 1:
                src = participants[0] if participants[1] == holders[0] else participants[1]
                nbytes = part.volume * itemsize
                transfers.append(Transfer(tensor, part, src, holders, nbytes, reduce=True))
                continue
            collectives[participants].append((part, holders))
            continue
        for p, ranks in entries:
            for rank in ranks:
                dsts = tuple(h for h in holders if h != rank)
                if dsts:
                    transfers.append(
                        Transfer(tensor, p, rank, dsts, p.volume * itemsize, reduce=True)
                    )
    reductions = []
    for participants, targets in collectives.items():
        if all(h == participants for _, h in targets):
            algorithm = "allreduce"
        elif all(len(h) == 1 for _, h in targets):
            owners = {h[0] for _, h in targets}
            algorithm = "reduce" if len(owners) == 1 else "reduce_scatter"
        else:
            algorithm = "allreduce"
        reductions.append(Reduction(tensor, algorithm, participants, tuple(targets), itemsize))
    return transfers, reductions
