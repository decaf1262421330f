"""The cost model: predicted seconds of each task of a plan, and of the step.

- compute: the busiest rank's FLOPs over the op's throughput (`Machine.flops_per_second`);
- point-to-point transfers, as a link-load model: each rank pays α per message and β per byte for
  the larger of what it sends and what it receives, and the task waits for the busiest rank. A
  transfer to k > 1 destinations is a broadcast down a binomial tree: ⌈log2(k+1)⌉ rounds, and
  every byte still reaches each destination once (the bytes sent are k times the rect);
- collectives, over p participants and n bytes: `allreduce` (ring) 2(p−1)α + 2(p−1)/p·nβ;
  `reduce_scatter` (ring) (p−1)α + (p−1)·bβ with b the largest owner's share; `reduce` to one
  owner, the better of a binomial tree ⌈log2 p⌉(α + nβ) and reduce-scatter then gather
  2(p−1)α + 2(p−1)/p·nβ. The bytes sent are those each algorithm puts on the wire, summed;
- a task's time is compute, then its incoming transfers, then its reductions, one after another;
  collectives over disjoint ranks run at once, those sharing a rank one after another; the step is
  the sum over tasks (bulk synchronous);
- a plan is infeasible when some rank's memory (`accounting.memory_per_rank`) exceeds the machine's.

Known blind spots: no overlap of communication with computation or between tasks (FlexFlow's
simulator models it); every op runs at one throughput unless calibrated, and memory-bound ops
(`set_zero`, elementwise, data loading) are counted as free or nearly; no network contention or
topology beyond per-rank link load; data re-fetched by a later task is paid again; memory is a
no-reuse upper bound on the peak.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from partitioner.accounting import memory_per_rank, task_flops
from partitioner.machine import Machine
from partitioner.plan import Plan, Reduction, Transfer


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

    @property
    def step_seconds(self) -> float:
        return sum(t.seconds for t in self.tasks)

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tasks)

    @property
    def memory_max(self) -> int:
        return max(self.memory.values(), default=0)

    @property
    def feasible(self) -> bool:
        return self.memory_max <= self.machine.memory_bytes

    def unit_seconds(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for task in self.tasks:
            out[task.unit] += task.seconds
        return dict(out)


def transfers_time(transfers: list[Transfer], machine: Machine) -> float:
    """The busiest rank's time to move `transfers` (link-load model)."""
    if not transfers:
        return 0.0
    sent: dict[int, float] = defaultdict(float)
    received: dict[int, float] = defaultdict(float)
    messages: dict[int, float] = defaultdict(float)
    for t in transfers:
        rounds = math.ceil(math.log2(len(t.dsts) + 1))
        sent[t.src] += t.nbytes
        messages[t.src] += rounds
        for dst in t.dsts:
            received[dst] += t.nbytes
            messages[dst] += rounds
    ranks = set(sent) | set(received)
    return max(
        messages[r] * machine.alpha + max(sent[r], received[r]) * machine.beta for r in ranks
    )


def reduction_cost(reduction: Reduction, machine: Machine) -> tuple[float, int]:
    """(seconds, bytes on the wire) of one collective."""
    p = len(reduction.participants)
    n = reduction.nbytes
    a, b = machine.alpha, machine.beta
    if p < 2 or n == 0:
        return 0.0, 0
    if reduction.algorithm == "allreduce":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b, 2 * (p - 1) * n
    if reduction.algorithm == "reduce_scatter":
        share: dict[int, int] = defaultdict(int)
        for rect, holders in reduction.targets:
            share[holders[0]] += rect.volume * reduction.itemsize
        largest = max(share.values())
        return (p - 1) * (a + largest * b), (p - 1) * n
    tree = math.ceil(math.log2(p)) * (a + n * b)
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b
    return (tree, (p - 1) * n) if tree <= ring else (ring, 2 * (p - 1) * n)


def plan_cost(graph: TaskGraph, plan: Plan, machine: Machine) -> PlanCost:
    flops = task_flops(graph, plan)
    costs = []
    for task, task_plan in zip(graph.tasks, plan.tasks):
        per_rank = flops[task.name]
        busiest = max(per_rank.values(), default=0.0)
        incoming = [t for t in task_plan.transfers if not t.reduce]
        partial = [t for t in task_plan.transfers if t.reduce]
        comm = transfers_time(incoming, machine) + transfers_time(partial, machine)
        sent = sum(t.nbytes * len(t.dsts) for t in task_plan.transfers)
        busy: dict[int, float] = defaultdict(float)
        for reduction in task_plan.reductions:
            seconds, wire = reduction_cost(reduction, machine)
            for rank in reduction.participants:
                busy[rank] += seconds
            sent += wire
        comm += max(busy.values(), default=0.0)
        costs.append(
            TaskCost(
                task.name,
                task_plan.unit,
                busiest,
                sum(per_rank.values()),
                int(sent),
                busiest / machine.flops_per_second(task.op),
                comm,
            )
        )
    return PlanCost(costs, memory_per_rank(graph, plan), machine)
