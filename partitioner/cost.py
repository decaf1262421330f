"""The cost model: predicted seconds of each task of a plan, and of the step.

- compute: the busiest rank's FLOPs over the op's throughput (`Machine.flops_per_second`); where
  the machine gives a memory bandwidth, the longer of that and the busiest rank's memory traffic
  (`accounting.bytes_per_rank`) over it (a roofline), plus the machine's overhead per task;
- point-to-point transfers, as a link-load model: each rank pays α per message and β per byte for
  the larger of what it sends and what it receives, and the task waits for the busiest rank. A
  transfer to k > 1 destinations is a broadcast down a binomial tree: ⌈log2(k+1)⌉ rounds, and
  every byte still reaches each destination once (the bytes sent are k times the rect);
- collectives, over p participants and n bytes, by the algorithm the machine prices least
  (`collective_prices`: ring, halving-doubling or binomial-tree all-reduce, ring or halving
  reduce-scatter, binomial-tree or ring reduce, ring or halving all-gather for a fetch that
  `partitioner.gathers` makes one); the bytes sent are those each algorithm puts on the wire,
  summed;
- where memory traffic is priced, messages and collectives also pay their local passes: two per
  byte sent or received (packing, unpacking), three per byte added (two reads, one write);
- a task's time is compute, then its incoming transfers and gathers, then its reductions, one
  after another;
  collectives over disjoint ranks run at once, those sharing a rank one after another; the step is
  the sum over tasks (bulk synchronous);
- a plan is infeasible when some rank's memory (`accounting.memory_per_rank`) exceeds the machine's.

Known blind spots: no overlap of communication with computation or between tasks (FlexFlow's
simulator models it); every op runs at one throughput unless calibrated (`machine.py`: per pass of
the filter from `legion-nn bench kernels`, at its mean over batch sizes, whatever a rank's piece
size) or its compute is `measured` (`bench.task_profile` runs the plan's pieces); memory-bound
ops (`set_zero`, elementwise) are free or nearly unless the machine gives a memory bandwidth, data
loading always is, and the roofline counts each rect once (a kernel that
re-reads from memory is underpriced); an all-reduce is priced as run in place (the runtime's case
for a just-zeroed gradient, not for a second reduction into it); no network contention or
topology beyond per-rank link load; data re-fetched by a later task is paid again; an update
fused into the kernel of its gradient (`runtime.step.rank_program`) is priced as the two tasks it was,
though the kernel overlaps them and moves no gradient; memory is a no-reuse upper bound on the
peak.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from operator import add

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.op_records import rate_passes
from partitioner.accounting import bytes_per_rank, flops_per_rank, memory_by_unit
from partitioner.collective_prices import reduction_cost
from partitioner.machine import Machine
from partitioner.plan import Plan, Transfer
from partitioner.transfers import TransferBlock, TransferSet, link_loads


@dataclass(frozen=True)
class TaskCost:
    task: str
    unit: str
    flops_max: float
    flops_total: float
    bytes_sent: int
    compute_s: float
    comm_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class PlanCost:
    tasks: list[TaskCost]
    memory: dict[int, int]
    machine: Machine
    #: bytes held per rank, by table row (`accounting.memory_by_unit`)
    memory_by_unit: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return step_seconds(self.tasks)

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tasks)

    @property
    def memory_max(self) -> int:
        return max(self.memory.values(), default=0)

    @property
    def feasible(self) -> bool:
        return self.memory_max <= self.machine.buffer_capacity

    def unit_seconds(self) -> dict[str, float]:
        return unit_seconds(self.tasks)


def step_seconds(tasks: list[TaskCost]) -> float:
    """The step is bulk synchronous: the sum of its tasks."""
    return sum(t.seconds for t in tasks)


def unit_seconds(tasks: list[TaskCost]) -> dict[str, float]:
    """Predicted seconds per table row."""
    out: dict[str, float] = defaultdict(float)
    for task in tasks:
        out[task.unit] += task.seconds
    return dict(out)


def transfers_time(transfers: Iterable[Transfer], machine: Machine) -> float:
    """The busiest rank's time to move `transfers` (link-load model)."""
    blocks = TransferSet.from_transfers(transfers).blocks
    ranks = [int(r) for b in blocks for r in (*b.src, *b.dsts)]
    return blocks_time(blocks, machine, max(ranks, default=-1) + 1)


def blocks_time(blocks: Iterable[TransferBlock], machine: Machine, nranks: int) -> float:
    """`transfers_time` of the transfers in `blocks`, over ranks 0..nranks-1."""
    return loads_time(*link_loads(blocks, nranks), machine)


def loads_time(
    sent: np.ndarray, received: np.ndarray, rounds: np.ndarray, machine: Machine
) -> float:
    """The busiest rank's time for per-rank bytes sent, bytes received and message rounds.

    A rank's bytes each way take the link's time, and together the host's network stack's where
    that is slower (`Machine.stack_beta`). Where the machine prices memory traffic, every byte a
    rank sends or receives also crosses its memory twice more: packed from the tensor into a
    message buffer, or unpacked from one."""
    if not len(rounds) or not rounds.any():
        return 0.0
    wire = np.maximum(sent, received) * machine.beta
    if machine.stack_beta:  # both ways through one host's stack (`Machine.stack_beta`)
        wire = np.maximum(wire, (sent + received) * machine.stack_beta)
    seconds = rounds * machine.alpha + wire
    per_byte = machine.seconds_per_memory_byte
    if per_byte:
        seconds = seconds + 2 * (sent + received) * per_byte
    return float(np.max(seconds))


def compute_seconds(task: Task, flops, machine: Machine):
    """Seconds to compute `flops` of `task` (a float, or an array of one per rank, each priced
    as the float would be), pass by pass (see `machine.py`)."""
    variant, passes = rate_passes(task)
    rates = [(share, machine.flops_per_second(task.op, name, variant)) for name, share in passes]
    if len({rate for _, rate in rates}) == 1:
        return flops / rates[0][1]
    return sum(flops * share / rate for share, rate in rates)


def bulk_seconds(graph: TaskGraph, plan: Plan, machine: Machine) -> float:
    """The plan's bulk-synchronous step (`plan_cost`'s, without the memory it also counts)."""
    return step_seconds(task_costs(graph, plan, machine))


def plan_cost(
    graph: TaskGraph, plan: Plan, machine: Machine, measured: Mapping[str, float] | None = None
) -> PlanCost:
    """The plan's predicted cost; `measured` gives, per task name, its busiest rank's compute
    seconds as run on this machine (`bench.task_profile`), in place of the FLOP model."""
    by_unit = memory_by_unit(graph, plan)
    total = np.zeros(plan.nranks, np.int64)
    for row in by_unit.values():
        total += row
    costs = task_costs(graph, plan, machine, measured)
    return PlanCost(costs, dict(enumerate(total.tolist())), machine, by_unit)


def task_costs(
    graph: TaskGraph, plan: Plan, machine: Machine, measured: Mapping[str, float] | None = None
) -> list[TaskCost]:
    """The predicted cost of every task, without the memory accounting (`measured`: see
    `plan_cost`); kept on the plan for the graph and machine where nothing is `measured`."""
    if measured is None:
        return plan.derived(
            "task_costs", (graph, machine), lambda: _task_costs(graph, plan, machine, None)
        )
    return _task_costs(graph, plan, machine, measured)


def _task_costs(
    graph: TaskGraph, plan: Plan, machine: Machine, measured: Mapping[str, float] | None
) -> list[TaskCost]:
    if measured is None and machine.pieces:
        measured = {
            task.name: float(per.max(initial=0.0)) - machine.task_overhead
            for task, per in zip(graph.tasks, compute_per_rank(graph, plan, machine))
            if per.any()
        }
    measured = measured or {}
    n = plan.nranks
    costs = []
    traffic = (
        bytes_per_rank(graph, plan) if machine.seconds_per_memory_byte else [None] * len(plan.tasks)
    )
    for task, task_plan, per_rank, moved in zip(
        graph.tasks, plan.tasks, flops_per_rank(graph, plan), traffic
    ):
        blocks = task_plan.transfer_set.blocks
        incoming = link_loads([b for b in blocks if not b.reduce], n)
        partial = link_loads([b for b in blocks if b.reduce], n)
        sent = sum(int(np.dot(b.nbytes, b.fanout)) for b in blocks)
        priced = [reduction_cost(r, machine) for r in task_plan.collectives]
        groups = [np.asarray(r.participants, np.int64) for r in task_plan.collectives]
        busy = busy_seconds(groups, range(len(groups)), [s for s, _ in priced], n)
        sent += sum(wire for _, wire in priced)
        costs.append(
            task_cost(
                task,
                task_plan.unit,
                per_rank,
                incoming,
                partial,
                busy,
                sent,
                machine,
                moved,
                measured=measured.get(task.name),
            )
        )
    return costs


Loads = tuple[np.ndarray, np.ndarray, np.ndarray]


def busy_seconds(
    groups: Sequence[np.ndarray],
    group: Sequence[int] | np.ndarray,
    seconds: Sequence[float] | np.ndarray,
    nranks: int,
) -> np.ndarray:
    """Per rank, the seconds of the collectives it takes part in, one after another: collective
    k (in order) runs over the ranks `groups[group[k]]` and takes `seconds[k]`. Float for float
    what adding each collective's seconds to its participants in turn gives; when the groups
    are disjoint, a group's ranks share one running sum."""
    busy = np.zeros(nranks)
    group = np.asarray(group, np.int64)
    seconds = np.asarray(seconds, float)
    if not len(seconds):
        return busy
    used = np.unique(group)
    members = [groups[g] for g in used.tolist()]
    ranks = np.concatenate(members)
    if int(np.bincount(ranks, minlength=nranks).max(initial=0)) <= 1:
        if len(used) == 1:
            busy[ranks] = reduce(add, seconds.tolist(), 0.0)
            return busy
        order = np.argsort(group, kind="stable")
        bounds = np.searchsorted(group[order], used, side="right")
        ordered = seconds[order].tolist()
        sums, start = [], 0
        for stop in bounds.tolist():
            sums.append(reduce(add, ordered[start:stop], 0.0))
            start = stop
        # one assignment for all groups (they are disjoint): hundreds of groups at 1024 ranks
        busy[ranks] = np.repeat(sums, [len(m) for m in members])
        return busy
    # Overlapping groups: every (collective, rank) pair in collective order, added one by one
    # by np.add.at (unbuffered, in index order), so each rank's seconds are summed in the same
    # order as a loop would.
    sizes = np.array([len(m) for m in groups], np.int64)[group]
    flat = np.concatenate([groups[g] for g in group.tolist()])
    np.add.at(busy, flat, np.repeat(seconds, sizes))
    return busy


def task_cost(
    task: Task,
    unit: str,
    per_rank: np.ndarray,
    incoming: Loads,
    partial: Loads,
    busy: np.ndarray,
    sent: int,
    machine: Machine,
    traffic: np.ndarray | None = None,
    measured: float | None = None,
) -> TaskCost:
    """One task's cost from its FLOPs per rank, the link loads (`transfers.link_loads`) of its
    incoming transfers and of its partial sums, its ranks' seconds in collectives
    (`busy_seconds`), the bytes it puts on the wire and its memory traffic per rank
    (`accounting.pieces_bytes`): what `task_costs` computes from a plan, and the search from
    parts of plans. A `measured` compute time replaces the modelled one; the runtime's overhead
    per task is still added."""
    busiest = float(per_rank.max(initial=0.0))
    comm = loads_time(*incoming, machine) + loads_time(*partial, machine)
    comm += float(busy.max(initial=0.0))
    return TaskCost(
        task.name,
        unit,
        busiest,
        float(per_rank.sum()),
        int(sent),
        (
            compute_time(task, per_rank, traffic, machine)
            if measured is None
            else measured + machine.task_overhead
        ),
        comm,
    )


def compute_time(
    task: Task, per_rank: np.ndarray, traffic: np.ndarray | None, machine: Machine
) -> float:
    """The slowest rank's compute: its FLOPs at the op's rate or, where the machine prices
    memory traffic and that takes longer, its bytes at the memory bandwidth (a roofline); plus
    the runtime's overhead per task."""
    seconds = compute_seconds(task, float(per_rank.max(initial=0.0)), machine)
    per_byte = machine.seconds_per_memory_byte
    if per_byte and traffic is not None:
        seconds = max(seconds, float(traffic.max(initial=0.0)) * per_byte)
    return seconds + machine.task_overhead


def compute_per_rank(graph: TaskGraph, plan: Plan, machine: Machine) -> list[np.ndarray]:
    """Per task (in `plan.tasks` order), each rank's compute seconds: from the machine's table
    of measured pieces where it has every piece of the task (`piece_times`), else as
    `compute_time` prices its busiest rank, with the runtime's per-task overhead paid by the
    ranks that have a piece; both over the rank's share of its host's cores
    (`Machine.core_share`: ranks beyond the cores time-share them, the overhead's Python as
    much as the kernels). For the step simulator, where each rank keeps
    its own time, and for `plan_cost`'s busiest rank."""
    from partitioner.piece_times import task_piece_times, working_ranks

    measured = (
        task_piece_times(graph, plan, machine.pieces)
        if machine.pieces
        else [None] * len(plan.tasks)
    )
    per_byte = machine.seconds_per_memory_byte
    modelled = any(m is None for m in measured)
    flops = flops_per_rank(graph, plan) if modelled else [None] * len(plan.tasks)
    traffic = bytes_per_rank(graph, plan) if modelled and per_byte else [None] * len(plan.tasks)
    share = machine.core_share(plan.nranks)
    out = []
    for index, (task, found, task_flops, moved) in enumerate(
        zip(graph.tasks, measured, flops, traffic)
    ):
        if found is not None:
            seconds = found * machine.compute_factor
        else:
            seconds = compute_seconds(task, np.asarray(task_flops, np.float64), machine)
            if moved is not None:
                seconds = np.maximum(seconds, moved * per_byte)
        working = working_ranks(plan, index)
        out.append(np.where(working, task_seconds(seconds, machine, share), 0.0))
    return out


def task_seconds(kernel_seconds, machine: Machine, share):
    """A task's seconds on a rank whose kernels take `kernel_seconds` (a float or an array per
    rank): plus the runtime's per-task overhead, over the rank's share of its host's cores
    (`Machine.core_share`). `compute_per_rank` and the simulator's tasks timed as they run
    (`runtime.step.piece_modes`) both price a task by it."""
    return (kernel_seconds + machine.task_overhead) / share
