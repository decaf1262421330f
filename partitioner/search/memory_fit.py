"""Fitting a step in a rank's memory: `auto`'s grids and each parameter's home.

`search.auto` chooses grids by the cost model's seconds, and prices memory by the count its rows
add up, every tensor and staging buffer held all step (`accounting.memory_by_unit`), within the
machine's memory less the process's own (`Machine.buffer_capacity`). The runtime holds less
(each buffer lives from its first use to its last, and a parameter with a sharded home is whole
only while a task reads it), so grids the search found to fit fit as placed. `fit` takes the
memory per rank of a plan from the caller (the runtime's placement, `runtime.step.rank_memory`,
with the process baseline) and searches what the rows cannot express:

- grids: auto's choice under the machine's memory, auto's choice with memory unlimited (the
  fastest), and the uniform families (`data`, `model`, `spatial`), each priced by the cost model;
- homes: for each of those, every parameter replicated, then the largest parameter held whole by
  several ranks sharded, then the next largest as well, and so on, until the plan fits.

Placing a plan's memory means building every rank's program where the step is simulated, most
of what fitting costs; a plan that cannot be the fastest is left out first (`_within_reach`:
its busiest rank computes longer than the searched grids' whole step, where those fit).

The fastest (grids, homes) that fits is returned. Sharding only adds messages (two gathers and a
reduce-scatter where an all-reduce was), so grids no faster than the best fit so far are not
sharded further, and the largest parameters go first because they save the most per gather. Where
nothing fits, `NoFit` names the least memory per rank among every pair it tried; each grid tried
with every parameter sharded is among them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from partitioner.cost import bulk_seconds
from partitioner.machine import Machine
from partitioner.pieces import graph_pieces
from partitioner.plan import Plan, build_plan
from partitioner.strategy import Strategy

#: the most bytes any rank of a plan holds at once
PeakFn = Callable[[TaskGraph, Plan], int]
#: a plan's predicted step, as `partition` reports it (the simulated step), given its
#: bulk-synchronous sum where the caller has it (None: it is found where needed)
StepFn = Callable[[TaskGraph, Plan, float | None], float]
#: a bound below `StepFn`'s step of a plan with any parameters' homes, found without building
#: its ranks' programs (None: no bound)
LowerFn = Callable[[TaskGraph, Plan], float | None]
#: whether `StepFn` gives a graph's plans on so many ranks their bulk-synchronous sums (plus a
#: constant for the ranks) rather than their simulated steps
SumsFn = Callable[[TaskGraph, int], bool]
#: a plan's bulk-synchronous sum and its simulated step where that is found (None where only
#: the sum is), each as `partition` reports it
ComparedFn = Callable[[TaskGraph, Plan], tuple[float, float | None]]
#: the plans whose predicted steps `least_step` compares: those whose bulk-synchronous seconds
#: are within this factor of the least. The simulator overlaps messages with compute, which the
#: sum cannot; where they overlap wholly a plan's step is the longer of the two, and the sum is
#: at most twice that, so a plan whose sum is more than twice the least is not the fastest
#: (seed-lcn-small at batch 512 on 4 ranks of a slow link: data parallelism sums 1.67 times the
#: search's grids and simulates 13% faster)
STEP_WITHIN = 2.0


class NoFit(LegionNNError):
    """No plan tried fits in a rank's memory; `least` is the fewest bytes per rank any needs."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(message)
        self.least = least


@dataclass(frozen=True)
class Fitted:
    strategy: Strategy
    seconds: float
    #: bytes per rank at most (the caller's `PeakFn`)
    peak: int


def fit(
    graph: TaskGraph,
    nranks: int,
    machine: Machine,
    candidates: list[Strategy],
    peak: PeakFn,
    deadline: float,
    step: StepFn | None = None,
    lower: LowerFn | None = None,
) -> Fitted:
    """The fastest of `candidates` (grids), each with the fewest parameters sharded that make it
    fit in `machine.memory_bytes`, by `step` where given (`least_step`), else by the cost model's
    sum; raises `NoFit` where none does. With `lower`, candidates that cannot be the fastest are
    left out before their memory is placed (`_within_reach`)."""
    cache = graph_pieces(graph)  # the search's grids, and the report's plan after
    found: dict[tuple, Fitted] = {}

    def evaluate(strategy: Strategy, plan: Plan | None = None) -> tuple[Fitted, Plan]:
        plan = plan or build_plan(graph, strategy, nranks, cache=cache)
        fitted = Fitted(strategy, bulk_seconds(graph, plan, machine), peak(graph, plan))
        found[_key(strategy)] = fitted
        return fitted, plan

    planned: dict[tuple, tuple[Strategy, Plan]] = {}
    for strategy in candidates:  # each distinct one planned once
        if _key(strategy) not in planned:
            planned[_key(strategy)] = (strategy, build_plan(graph, strategy, nranks, cache=cache))
    capacity = machine.memory_bytes
    first: dict[tuple, tuple[Fitted, Plan]] = {}
    if step is not None and lower is not None:
        planned = _within_reach(graph, machine, planned, first, evaluate, step, lower)
    for key, (strategy, plan) in planned.items():
        if key not in first:
            first[key] = evaluate(strategy, plan)
    best: Fitted | None = None
    feasible: list[tuple[Fitted, Plan]] = []
    for key in sorted(first, key=lambda k: first[k][0].seconds):
        fitted, plan = first[key]
        every = _shardable(graph, plan)
        queue = list(every)
        if fitted.peak > capacity and every:
            # where every parameter sharded does not fit, no fewer do (a sharded home holds less
            # than its replica, and its gathered copy only while it is read): a plan that fits
            # with none was sharded one parameter more at a time, a plan each (ResNet-50's 161
            # took minutes), and it names the least memory any plan needs
            most = evaluate(replace(fitted.strategy, sharded=frozenset(every)))
            if most[0].peak > capacity:
                queue = []
        while fitted.peak > capacity and queue:
            if best is not None and fitted.seconds >= best.seconds:
                break
            if time.monotonic() > deadline:  # out of time: every parameter sharded, which fits
                fitted, plan = most
                break
            sharded = fitted.strategy.sharded | {queue.pop(0)}
            fitted, plan = evaluate(replace(fitted.strategy, sharded=sharded))
        if fitted.peak <= capacity:
            feasible.append((fitted, plan))
            if best is None or fitted.seconds < best.seconds:
                best = fitted
    if best is None:
        least = min(found.values(), key=lambda f: f.peak)
        homes = (
            f", {len(least.strategy.sharded)} parameters sharded" if least.strategy.sharded else ""
        )
        raise NoFit(
            f"no plan of {graph.network or 'the network'} at batch {graph.batch} on {nranks} "
            f"ranks fits in {machine.rank_memory_gib:g} GiB per rank: the smallest tried needs "
            f"{least.peak / 2**30:.2f} GiB per rank ({_grids(least.strategy)}{homes})",
            least.peak,
        )
    if step is None:
        return best
    fitted, _ = feasible[
        least_step(
            [f.seconds for f, _ in feasible],
            lambda i: step(graph, feasible[i][1], feasible[i][0].seconds),
        )
    ]
    return fitted


def _within_reach(
    graph: TaskGraph,
    machine: Machine,
    planned: dict[tuple, tuple[Strategy, Plan]],
    first: dict[tuple, tuple[Fitted, Plan]],
    evaluate: Callable[[Strategy, Plan], tuple[Fitted, Plan]],
    step: StepFn,
    lower: LowerFn,
) -> dict[tuple, tuple[Strategy, Plan]]:
    """`planned` less the plans that cannot be chosen: where the first (the search's grids) has
    the least bulk-synchronous sum of them all and fits as it is, it is the best fit by sums
    before any other is looked at, so `fit` shards none (it shards no plan whose sum is not below
    the best fit's) and its step S is among those `least_step` compares; a plan whose step is
    surely longer than S (`lower`) is then never chosen. The first is placed here (into
    `first`) to find out, after its step is found (the step the caller may find while its
    memory is placed elsewhere: `StepModel.foresee`'s `placing`)."""
    sums = {key: bulk_seconds(graph, plan, machine) for key, (_, plan) in planned.items()}
    lead = next(iter(planned))
    if sums[lead] > min(sums.values()):
        return planned
    best = step(graph, planned[lead][1], sums[lead])
    fitted, _ = first[lead] = evaluate(*planned[lead])
    if fitted.peak > machine.memory_bytes:
        return planned
    kept = {}
    for key, (strategy, other) in planned.items():
        bound = None if key == lead else lower(graph, other)
        if bound is None or bound <= best:
            kept[key] = (strategy, other)
    return kept


def least_step(
    bulk_seconds: list[float],
    step: Callable[[int], float],
    bound: Callable[[int], float | None] | None = None,
) -> int:
    """The index of the plan of least predicted step (`step(index)`), among those whose
    bulk-synchronous seconds are within `STEP_WITHIN` of the least; ties go to the earlier.
    `bound(index)`, a bound below a plan's step (None: none), spares the step of a plan whose
    bound is above the least step found so far: the plans are stepped in order of their sums."""
    least = min(bulk_seconds)
    near = [i for i, b in enumerate(bulk_seconds) if b <= least * STEP_WITHIN]
    if len(near) == 1:
        return near[0]
    if bound is None:
        return min(near, key=step)
    best: tuple[float, int] | None = None
    for i in sorted(near, key=lambda i: bulk_seconds[i]):
        below = bound(i) if best is not None else None
        if below is not None and below > best[0]:
            continue  # its step is above the least found: neither the least nor a tie
        found = (step(i), i)
        best = found if best is None else min(best, found)
    return best[1]


def _key(strategy: Strategy) -> tuple:
    return tuple(sorted(strategy.unit_grids.items())), strategy.sharded


def _shardable(graph: TaskGraph, plan: Plan) -> list[str]:
    """The parameters some part of whose home several ranks hold, largest first."""
    names = [
        name
        for name, tensor in graph.tensors.items()
        if tensor.kind == "param"
        and name not in plan.sharded
        and plan.homes[name].holder_count.max(initial=0) > 1
    ]
    return sorted(names, key=lambda n: (-graph.tensors[n].nbytes, n))


def _grids(strategy: Strategy) -> str:
    return strategy.name if strategy.name != "auto" else "auto's grids"
