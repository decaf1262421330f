"""`auto`: per-unit grids, by dynamic programming on a chain of units and local search elsewhere.

Each unit is offered the same few *families* of grids: `data`, `model`, `spatial`, and the mixtures
`batch2×model`, `channels4×spatial`, `batch4×spatial` (a family a unit cannot take falls back to
its batch split). On a chain, a unit's cost (its tasks, their transfers and reductions, its
parameters' updates) depends only on its own grid and its predecessor's, because a unit reads
only its predecessor's output and reduces only into its predecessor's gradient. One plan with
family x on the even units and y on the odd ones therefore prices every even unit under (y → x)
and every odd unit under (x → y): K² plans give every transition cost exactly, and the DP over
them finds the cheapest assignment under the cost model. The three built-in strategies (data,
model, spatial) are priced first, whatever the time limit; then the other pairs until the limit
(checked between plans) runs out, and the DP uses the pairs priced so far (a missing pair, or one
whose plan does not fit in memory, is never chosen). So `auto` is never worse than the best of
data, model and spatial.

`coupling.is_chain` decides whether a graph is a chain; the Network API lowers to chains. On
other graphs (a tensor feeding two units, a shared parameter) a unit's cost may depend on any
unit's grid, so `auto` runs a bounded local search instead: it starts from the best uniform family
(the three built-ins first, whatever the limit), then visits the units, costliest first, trying
each other family for that unit alone and keeping a change when the whole plan predicts a faster
step that fits in memory; it repeats until a pass changes nothing or the time limit passes, and
returns the best plan found so far. Plans are priced whole, so this is exact for what it visits,
but it can stop at a local optimum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from partitioner.accounting import fits
from partitioner.cost import step_seconds, task_costs, unit_seconds
from partitioner.coupling import is_chain
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import build_plan, task_rows
from partitioner.strategy import Grid, Strategy, Unit, balanced, builtin_grid, find_units

BUILTIN_FAMILIES = ("data", "model", "spatial")
FAMILIES = BUILTIN_FAMILIES + ("batch2×model", "channels4×spatial", "batch4×spatial")
_MIXTURES = {
    "batch2×model": ((0,), 2, (1,)),
    "channels4×spatial": ((1,), 4, (2, 3)),
    "batch4×spatial": ((0,), 4, (2, 3)),
}


def family_grid(unit: Unit, family: str, nranks: int) -> Grid:
    if family in ("data", "model", "spatial"):
        return builtin_grid(unit, family, nranks)
    first, parts, rest = _MIXTURES[family]
    usable = all(d in unit.splittable for d in first + rest)
    if not usable or nranks % parts or all(unit.extents[d] == 1 for d in rest):
        return builtin_grid(unit, "data", nranks)
    head = balanced(unit.extents, first, parts)
    tail = balanced(unit.extents, rest, nranks // parts)
    return tuple(max(a, b) for a, b in zip(head, tail))


@dataclass
class Choice:
    unit: str
    family: str
    grid: Grid
    seconds: float
    data_seconds: float


@dataclass
class SearchResult:
    strategy: Strategy
    choices: list[Choice]
    #: whole plans built and costed
    plans_priced: int
    note: str


@dataclass(frozen=True)
class Priced:
    """What the search keeps of a costed plan."""

    unit_seconds: dict[str, float]
    step_seconds: float
    feasible: bool


class _Pricer:
    """Plans and costs strategies given as one family per unit, each distinct set of grids once."""

    def __init__(self, graph: TaskGraph, units: list[Unit], nranks: int, machine: Machine):
        self.graph, self.units, self.nranks, self.machine = graph, units, nranks, machine
        self.cache = PieceCache(graph)
        self._found: dict[tuple[Grid, ...], Priced] = {}

    def strategy(self, families: list[str]) -> Strategy:
        grids = {u.name: family_grid(u, f, self.nranks) for u, f in zip(self.units, families)}
        return Strategy("auto", grids)

    def price(self, families: list[str]) -> Priced:
        strategy = self.strategy(families)
        key = tuple(strategy.unit_grids[u.name] for u in self.units)
        if key not in self._found:
            plan = build_plan(self.graph, strategy, self.nranks, cache=self.cache)
            costs = task_costs(self.graph, plan, self.machine)
            self._found[key] = Priced(
                unit_seconds(costs),
                step_seconds(costs),
                fits(self.graph, plan, self.machine.memory_bytes),
            )
        return self._found[key]

    @property
    def priced(self) -> int:
        return len(self._found)


def _rank(cost: Priced) -> tuple[bool, float]:
    """Sort key: plans that fit in memory first, then by predicted step."""
    return (not cost.feasible, cost.step_seconds)


def auto(graph: TaskGraph, nranks: int, machine: Machine, time_limit: float = 30.0) -> SearchResult:
    units = find_units(graph)
    pricer = _Pricer(graph, units, nranks, machine)
    deadline = time.monotonic() + time_limit
    if is_chain(graph, units, task_rows(graph)):
        families, note = _chain_dp(pricer, deadline)
    else:
        families, note = _local_search(pricer, deadline)
    strategy = pricer.strategy(families)
    final = pricer.price(families).unit_seconds
    data = pricer.price(["data"] * len(units)).unit_seconds
    choices = [
        Choice(
            u.name, f, strategy.unit_grids[u.name], final.get(u.name, 0.0), data.get(u.name, 0.0)
        )
        for u, f in zip(units, families)
    ]
    return SearchResult(strategy, choices, pricer.priced, note)


def _chain_dp(pricer: _Pricer, deadline: float) -> tuple[list[str], str]:
    units = pricer.units
    k = len(FAMILIES)
    priced: dict[tuple[int, int], dict[str, float]] = {}
    feasible: dict[tuple[int, int], bool] = {}
    order = [(x, x) for x in range(k)] + [(x, y) for x in range(k) for y in range(k) if x != y]
    for x, y in order:
        if x >= len(BUILTIN_FAMILIES) and time.monotonic() > deadline:
            break
        families = [FAMILIES[x] if i % 2 == 0 else FAMILIES[y] for i in range(len(units))]
        cost = pricer.price(families)
        priced[(x, y)] = cost.unit_seconds
        feasible[(x, y)] = cost.feasible

    def unit_cost(i: int, prev: int | None, own: int) -> float:
        key = (own, prev if prev is not None else own) if i % 2 == 0 else (prev, own)
        if key not in priced or not feasible[key]:
            return float("inf")
        return priced[key].get(units[i].name, 0.0)

    best: list[dict[int, tuple[float, list[int]]]] = [
        {q: (unit_cost(0, None, q), [q]) for q in range(k)}
    ]
    for i in range(1, len(units)):
        layer = {}
        for q in range(k):
            layer[q] = min(
                ((c + unit_cost(i, p, q), path + [q]) for p, (c, path) in best[-1].items()),
                key=lambda item: item[0],
            )
        best.append(layer)
    seconds, path = min(best[-1].values(), key=lambda item: item[0])
    families = [FAMILIES[q] for q in path]
    if seconds == float("inf"):
        # no assignment fits in memory: the fastest of the uniform plans priced, infeasible
        families = min(
            ([FAMILIES[x]] * len(units) for x in range(k) if (x, x) in priced),
            key=lambda f: _rank(pricer.price(f)),
        )
    note = "exact DP over all family pairs"
    if len(priced) < k * k:
        note = f"time limit: DP over {len(priced)} of {k * k} family pairs"
    return families, note


def _local_search(pricer: _Pricer, deadline: float) -> tuple[list[str], str]:
    n = len(pricer.units)
    pure = []
    for index, family in enumerate(FAMILIES):
        if index >= len(BUILTIN_FAMILIES) and time.monotonic() > deadline:
            break
        pure.append([family] * n)
    current = min(pure, key=lambda f: _rank(pricer.price(f)))
    best = pricer.price(current)
    passes = 0
    while time.monotonic() <= deadline:
        passes += 1
        changed = False
        seconds = best.unit_seconds
        for i in sorted(range(n), key=lambda i: -seconds.get(pricer.units[i].name, 0.0)):
            grid = family_grid(pricer.units[i], current[i], pricer.nranks)
            for family in FAMILIES:
                if time.monotonic() > deadline:
                    return current, f"time limit: local search, {pricer.priced} plans priced"
                if family_grid(pricer.units[i], family, pricer.nranks) == grid:
                    continue
                trial = current[:i] + [family] + current[i + 1 :]
                cost = pricer.price(trial)
                if _rank(cost) < _rank(best):
                    current, best, changed = trial, cost, True
                    grid = family_grid(pricer.units[i], family, pricer.nranks)
        if not changed:
            return current, (
                f"not a chain: local search converged after {passes} passes, "
                f"{pricer.priced} plans priced"
            )
    return current, f"time limit: local search, {pricer.priced} plans priced"
