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
   gradient), `reduce` when there is one owner (the loss, evaluate's sums, to rank 0). Where
   the next task to touch the target adds into it with the same all-reduce (micro-batches'
   gradients), the sum waits for it: each rank adds into its own copy meanwhile
   (`deferred_sums.py`, `TaskPlan.deferred`).

Resident tensors live where they are read: the home of data and of a parameter holds, on each
rank, exactly the rects that rank's pieces read (an untied weight set under a spatial split lives
with its output positions; a parameter read whole by every batch piece is replicated). Its gradient
and optimizer state share its home; its update runs on every holder, each on its own copy. Reading
resident data is therefore free (the loader loads each rank's halo); the price of a replicated
parameter is the all-reduce of its gradient and the memory of its copies.

Representation: planning 1024 ranks meets some 10⁵ pieces and 10⁵–10⁶ messages, so a `TaskPlan`
keeps them as arrays (`pieces.PieceSet`, `transfers.TransferSet`) and the steps above run over
all the pieces of a task at once (`messages.py`). The plan also records who holds what: the
homes, and per task the layout after it of every tensor it writes or reduces into
(`TaskPlan.holdings`, made by `holdings_after`; a `Layout` is arrays of cuts and holders, and
the record shares the layouts the planner made, so it costs no copy), and from it, when first
read, the task that last wrote each cell (`Plan.written_by`). The rank programs (what a rank
holds, and after which task a copy's data is ready), the accounting (`Plan.layouts`, the
layouts after the step) and the search's replay (`layout_cache.py`) read that record or the
function that makes it rather than replaying writes. `TaskPlan.pieces` and
`TaskPlan.transfers` are read-only views of the arrays, made when first read, for executors and
`verify_plan`; the arrays are frozen, so an edit makes a new `TaskPlan`, which the cost model
and `verify_plan` both read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.op_records import packed_tensors, storage_order
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner import boxes
from partitioner.accesses import Columns, TaskAccesses, task_accesses
from partitioner.deferred_sums import defer_sums
from partitioner.gathers import OutrightWrites, gather_of
from partitioner.layout import Layout
from partitioner.messages import CollectiveSum, Copies
from partitioner.pieces import Piece, PieceCache, PieceSet, graph_pieces, homed_pieces
from partitioner.plan_memo import PlanMemo
from partitioner.strategy import (
    Grid,
    Strategy,
    find_units,
    grid_label,
    is_homed,
    param_of,
    strategy_label,
)
from partitioner.task_plan import Reduction, TaskPlan
from partitioner.transfers import Transfer, TransferSet

__all__ = ["Piece", "Plan", "PlanError", "Reduction", "TaskPlan", "Transfer", "build_plan"]


class PlanError(LegionNNError):
    """A strategy that cannot be planned (overlapping writes, a read of unwritten data)."""


@dataclass
class Plan:
    network: str
    batch: int
    nranks: int
    strategy: str
    unit_grids: dict[str, Grid]
    tasks: list[TaskPlan]
    #: the layouts of data, parameters and state (and their gradients), before the first task
    homes: dict[str, Layout]
    #: per unit whose reducer sums over some dims, how many of its grid's last dims those are
    summed: dict[str, int] = field(default_factory=dict)
    #: the parameters whose homes are sharded (`Strategy.sharded`)
    sharded: frozenset[str] = frozenset()
    #: values derived from the plan and the objects they were derived with (`derived`)
    _derived: dict[str, tuple[tuple, object]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def derived(self, what: str, inputs: tuple, make: Callable[[], object]) -> object:
        """`make()`, kept as `what` of this plan while asked with the same `inputs` (compared
        by identity: the graph and machine it was derived with): the costs of its tasks and the
        memory its ranks hold, which a command's search, fit and report each read, found once."""
        found = self._derived.get(what)
        if (
            found is not None
            and len(found[0]) == len(inputs)
            and all(a is b for a, b in zip(found[0], inputs))
        ):
            return found[1]
        value = make()
        self._derived[what] = (inputs, value)
        return value

    @property
    def label(self) -> str:
        """`strategy.strategy_label` of the plan's strategy."""
        return strategy_label(self.strategy, self.sharded)

    def grid_label(self, unit: str) -> str:
        """`strategy.grid_label` of the unit's grid (its reduction dims after `Σ`)."""
        return grid_label(self.unit_grids[unit], self.summed.get(unit, 0))

    @property
    def layouts(self) -> dict[str, Layout]:
        """Every tensor's layout after the step: its home, then each task's `holdings`."""
        out = dict(self.homes)
        for task_plan in self.tasks:
            out.update(task_plan.holdings)
        return out

    @cached_property
    def written_by(self) -> tuple[Mapping[str, np.ndarray], ...]:
        """Per task, per tensor of its `holdings`, per cell of that layout: the index of the task
        that last wrote or reduced into the cell (-1: none this step). Read-only arrays, made
        from the record when first read (the rank programs time copies by them)."""
        before = {name: np.full(home.ncells, -1, boxes.INDEX) for name, home in self.homes.items()}
        out = []
        for index, task_plan in enumerate(self.tasks):
            after = writers_after(index, task_plan, before)
            before.update(after)
            out.append(MappingProxyType(after))
        return tuple(out)


def build_plan(
    graph: TaskGraph,
    strategy: Strategy,
    nranks: int,
    resident_homes: Mapping[str, Layout] | None = None,
    cache: PieceCache | None = None,
) -> Plan:
    """The plan of one training step of `graph` under `strategy` on `nranks` ranks.

    `resident_homes` fixes the homes of parameters and state (and their gradients), for instance
    to those of the full-batch step while planning a run's smaller last batch, so that every rank
    keeps updating the copies it holds. `cache` holds the pieces it reuses (by default the
    graph's, `pieces.graph_pieces`, which a search adds the grids it chose to)."""
    grids, first_ranks = strategy.task_placement(graph)
    for name, grid in grids.items():
        used = 1
        for parts in grid:
            used *= parts
        if first_ranks[name] + used > nranks:
            raise PlanError(
                f"task {name}: grid {list(grid)} from rank {first_ranks[name]} needs "
                f"{first_ranks[name] + used} ranks, only {nranks}"
            )
    homed = {task.name for task in graph.tasks if is_homed(graph, task)}
    if cache is None:
        cache = graph_pieces(graph)
    pieces = {
        task.name: cache.get(graph, task, grids[task.name]).placed_from(first_ranks[task.name])
        for task in graph.tasks
        if task.name not in homed
    }
    homes = _homes(graph, pieces, strategy.sharded)
    if resident_homes:
        homes.update((name, home) for name, home in resident_homes.items() if name in homes)
    units = task_rows(graph)
    layouts: dict[str, Layout] = dict(homes)
    copies = Copies()
    memo = cache.memo
    plans = []
    writes = OutrightWrites(graph)
    for task in graph.tasks:
        if task.name in homed:
            plan = TaskPlan(
                task.name,
                units[task.name],
                None,
                homed_pieces(graph, task, homes),
                TransferSet(),
                holdings=homed_holdings(task, homes),
            )
            writes.forget(task)
        else:
            plan = _plan_partitioned(
                graph,
                task,
                units[task.name],
                grids[task.name],
                pieces[task.name],
                layouts,
                copies,
                memo,
                writes,
            )
        layouts.update(plan.holdings)
        plans.append(plan)
    return Plan(
        graph.network,
        graph.batch,
        nranks,
        strategy.name,
        dict(strategy.unit_grids),
        defer_sums(graph, plans),
        homes,
        {u.name: len(u.summed) for u in find_units(graph) if u.summed},
        strategy.sharded,
    )


def _homes(
    graph: TaskGraph, pieces: Mapping[str, PieceSet], sharded: frozenset[str] = frozenset()
) -> dict[str, Layout]:
    readers: dict[str, list[Columns]] = defaultdict(list)
    for task in graph.tasks:
        found = pieces.get(task.name)
        if found is not None:
            for tensor, columns in resident_reads(graph, task, found):
                readers[tensor].append(columns)
    homes = {}
    for name, tensor in graph.tensors.items():
        owned = param_of(graph, name) is not None  # optimizer state lives with its parameter
        if tensor.kind in ("data", "param") or (tensor.kind == "state" and not owned):
            homes[name] = home_layout(graph, name, readers.get(name, []), name in sharded)
    for name in graph.tensors:
        owner = param_of(graph, name)
        if owner is not None and name not in homes:
            homes[name] = homes[owner]
    return homes


def resident_reads(graph: TaskGraph, task: Task, pieces: PieceSet) -> list[tuple[str, Columns]]:
    """(tensor, (ranks, lo, hi)) for each requirement of `task` reading a resident tensor."""
    return [
        (req.tensor, (pieces.owners, pieces.req_lo[j], pieces.req_hi[j]))
        for j, req in enumerate(task.requirements)
        if req.privilege.reads and graph.tensors[req.tensor].resident
    ]


def home_layout(
    graph: TaskGraph, name: str, found: Sequence[Columns], sharded: bool = False
) -> Layout:
    """The home of data or a parameter: each rank holds what its readers' pieces read (`found`,
    from `resident_reads`); a tensor nobody reads lives whole on rank 0. A `sharded` home cuts
    every part several ranks read among them (`Layout.sharded`, along the tensor's storage
    order)."""
    ndim = len(graph.tensors[name].dims)
    if found:
        ranks, lo, hi = (np.concatenate(column) for column in zip(*found))
    else:
        ranks = np.zeros(1, boxes.INDEX)
        lo, hi = boxes.from_rects([graph.tensors[name].rect], ndim)
    layout = Layout.from_arrays(ndim, ranks, lo, hi)
    if sharded:
        layout = layout.sharded(storage_order(ndim, name in packed_tensors(graph.tasks)))
    return layout


def task_rows(graph: TaskGraph) -> dict[str, str]:
    """The table row of every task: its unit, or for helpers the unit of the task they serve."""
    out: dict[str, str] = {}
    for unit in find_units(graph):
        for name in unit.forward + unit.backward:
            out[name] = unit.name
    pending: list[int] = []
    for position, task in enumerate(graph.tasks):
        if task.op == "data":
            out[task.name] = "data"
        elif task.name not in out:
            pending.append(position)
    # a helper takes the row of the first task (in the graph's order) to touch what it touches,
    # of those that are no helper of the kinds below and have a row by then: every unit's task,
    # and the helpers before it
    touching: dict[str, list[int]] = defaultdict(list)
    for position, task in enumerate(graph.tasks):
        if task.op not in ("data", "update", "set_zero"):
            for tensor in {r.tensor for r in task.requirements}:
                touching[tensor].append(position)
    waiting = set(pending)
    for position in pending:
        task = graph.tasks[position]
        tensors = {r.tensor for r in task.requirements}
        owner = param_of(graph, task.requirements[0].tensor)
        if owner is not None:
            tensors.add(owner)
        first = min(
            (
                next((at for at in touching[t] if at not in waiting), len(graph.tasks))
                for t in tensors
            ),
            default=len(graph.tasks),
        )
        if first < len(graph.tasks):
            out[task.name] = out[graph.tasks[first].name]
        else:
            out[task.name] = task.layer or task.name
        waiting.discard(position)
    return out


def written_layout(
    graph: TaskGraph, task: Task, tensor: str, found: list[Columns], memo: PlanMemo | None = None
) -> Layout:
    """The layout `task` leaves `tensor` in: one holder per written rect (the `memo`'s object
    for that content, where given)."""
    ranks, lo, hi = (np.concatenate(column) for column in zip(*found))
    ndim = len(graph.tensors[tensor].dims)
    if memo is None:
        layout = Layout.from_arrays(ndim, ranks, lo, hi)
    else:
        layout = memo.layout(ndim, ranks, lo, hi)
    shared = np.flatnonzero(layout.holder_count > 1)
    if len(shared):
        holders = layout.holders[int(shared[0])]
        raise PlanError(
            f"task {task.name}: ranks {list(holders)} write overlapping rects of {tensor}"
        )
    return layout


def reductions_of(tensor: str, itemsize: int, collectives: list[CollectiveSum]) -> list[Reduction]:
    """The `Reduction`s of the collectives `messages.combine` found for `tensor`: a
    reduce-scatter runs among its contributors, a reduce or an all-reduce among all."""
    out = []
    for participants, targets, contributors in collectives:
        algorithm = _algorithm(participants, targets)
        if algorithm != "reduce_scatter":
            contributors = ()
        out.append(
            Reduction(tensor, algorithm, participants, tuple(targets), itemsize, (), contributors)
        )
    return out


def _failure(task: Task) -> Callable[[str], PlanError]:
    def fail(message: str) -> PlanError:
        return PlanError(f"task {task.name} {message}")

    return fail


def homed_holdings(task: Task, homes: Mapping[str, Layout]) -> dict[str, Layout]:
    """The holdings after a homed task: what it writes stays in its home."""
    return {r.tensor: homes[r.tensor] for r in task.requirements if r.privilege.writes}


def holdings_after(
    graph: TaskGraph,
    task: Task,
    touched: TaskAccesses,
    layouts: Mapping[str, Layout],
    memo: PlanMemo | None = None,
) -> dict[str, Layout]:
    """The holdings after partitioned `task` (its accesses `touched`), given the `layouts`
    before it: a written tensor is held where it was written (`written_layout`, one holder per
    rect), and a sum where its target was zeroed, by every holder of each cell."""
    after = {
        tensor: written_layout(graph, task, tensor, found, memo)
        for tensor, found in touched.writes.items()
    }
    for tensor, _ in touched.reduces:
        if tensor in layouts:
            after.setdefault(tensor, layouts[tensor])
    return after


def writers_after(
    index: int, task_plan: TaskPlan, before: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """`Plan.written_by` of task `index`, given the writers `before` it: every held cell of a
    tensor it writes (a homed task: all it holds) is its own, and so is every cell of a sum it
    reduces into that a piece's rect overlaps; the other cells keep their writers."""
    requirements = [
        (req, pieces.req_lo[j], pieces.req_hi[j])
        for pieces in task_plan.piece_sets
        for j, req in enumerate(pieces.requirements)
    ]
    reduced = [(r.tensor, lo, hi) for r, lo, hi in requirements if r.privilege is Privilege.REDUCE]
    if task_plan.grid is None:
        written = set(task_plan.holdings)
    else:
        written = {
            r.tensor
            for r, _, _ in requirements
            if r.privilege.writes and r.privilege is not Privilege.REDUCE
        }
        written |= {s.requirements[j].tensor for s in task_plan.piece_sets for j, *_ in s.sums}
    out = {
        tensor: np.where(layout.holder_count > 0, index, -1)
        if tensor in written
        else before[tensor].copy()
        for tensor, layout in task_plan.holdings.items()
    }
    for tensor, lo, hi in reduced:
        if tensor in written:
            continue
        bounds = np.concatenate((lo, hi), axis=1)
        if len(bounds) and (bounds == bounds[0]).all():  # one rect for all (a weight's gradient)
            lo, hi = lo[:1], hi[:1]
        _, cells, _, _ = boxes.grid_overlaps(task_plan.holdings[tensor].cut_arrays, lo, hi)
        out[tensor][cells] = index
    for array in out.values():
        array.flags.writeable = False
    return out


def _plan_partitioned(
    graph: TaskGraph,
    task: Task,
    unit: str,
    grid: Grid,
    pieces: PieceSet,
    layouts: Mapping[str, Layout],
    copies: Copies,
    memo: PlanMemo,
    writes: OutrightWrites,
) -> TaskPlan:
    """A partitioned task's plan, given the `layouts` before it; the `copies` held and the
    last `writes` are brought up to date."""
    fail = _failure(task)
    touched = task_accesses(task, pieces)
    blocks = []
    gathered = []
    for tensor, found in touched.reads:
        layout = layouts.get(tensor)
        if layout is None:
            raise fail(f"reads {tensor}, which no earlier task wrote")
        accesses = memo.accesses(found)
        fresh = copies.fresh(tensor, layout, accesses, keep=not graph.tensors[tensor].resident)
        itemsize = graph.tensors[tensor].itemsize
        block = memo.fetch(tensor, itemsize, layout, accesses, fresh, fail)
        gather = None
        if len(block) and writes.outright(tensor, layout, task.name):
            gather = gather_of(tensor, itemsize, layout, accesses, fresh)
        if gather is None:
            blocks.append(block)
        else:
            gathered.append((block, gather))
    after = holdings_after(graph, task, touched, layouts, memo)
    writes.record(task.name, touched, pieces, after)
    reductions = []
    nreads = len(pieces) * len(task.requirements)
    for position, (tensor, found) in enumerate(touched.reduces):
        if tensor not in after:
            raise fail(f"reduces into {tensor}, which was never zeroed")
        itemsize = graph.tensors[tensor].itemsize
        block, collectives = memo.combine(
            tensor, itemsize, after[tensor], memo.accesses(found), nreads + position, fail
        )
        blocks.append(block)
        reductions += reductions_of(tensor, itemsize, collectives)
    return TaskPlan(
        task.name,
        unit,
        grid,
        [pieces],
        TransferSet(tuple(blocks)),
        reductions,
        after,
        gathered=gathered,
    )


def _algorithm(participants: tuple[int, ...], targets: list[tuple[Rect, tuple[int, ...]]]) -> str:
    if all(h == participants for _, h in targets):
        return "allreduce"
    if all(len(h) == 1 for _, h in targets):
        return "reduce" if len({h[0] for _, h in targets}) == 1 else "reduce_scatter"
    return "allreduce"
