"""`auto`: per-unit grids chosen by dynamic programming over a chain of units.

Each unit is offered the same few *families* of grids: `data`, `model`, `spatial`, and the mixtures
`batch2×model`, `channels4×spatial`, `batch4×spatial` (a family a unit cannot take falls back to
its batch split). On a chain, a unit's cost (its tasks, their transfers and reductions, its
parameters' updates) depends only on its own grid and its predecessor's, because a unit reads
only its predecessor's output and reduces only into its predecessor's gradient. One plan with
family x on the even units and y on the odd ones therefore prices every even unit under (y → x)
and every odd unit under (x → y): K² plans give every transition cost exactly, and the DP over
them finds the cheapest assignment under the cost model. The pure strategies (x = y) are planned
first; when the time limit runs out, the DP uses the pairs priced so far (a missing pair is never
chosen), so `auto` is never worse than the best of data, model and spatial.

Networks here lower to chains of units (the Network API is sequential). A graph whose units are not
a chain gets the best pure strategy, and says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from partitioner.cost import PlanCost, plan_cost
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import build_plan
from partitioner.strategy import Grid, Strategy, Unit, balanced, builtin_grid, find_units

FAMILIES = ("data", "model", "spatial", "batch2×model", "channels4×spatial", "batch4×spatial")
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
    pairs_priced: int
    pairs_total: int
    note: str


def _strategy(units: list[Unit], families: list[str], nranks: int, name: str) -> Strategy:
    grids = {u.name: family_grid(u, f, nranks) for u, f in zip(units, families)}
    return Strategy(name, grids)


def auto(graph: TaskGraph, nranks: int, machine: Machine, time_limit: float = 30.0) -> SearchResult:
    units = find_units(graph)
    start = time.monotonic()
    cache = PieceCache(graph)
    k = len(FAMILIES)
    priced: dict[tuple[int, int], dict[str, float]] = {}
    feasible: dict[tuple[int, int], bool] = {}
    order = [(x, x) for x in range(k)] + [(x, y) for x in range(k) for y in range(k) if x != y]
    for x, y in order:
        if priced and time.monotonic() - start > time_limit:
            break
        families = [FAMILIES[x] if i % 2 == 0 else FAMILIES[y] for i in range(len(units))]
        strategy = _strategy(units, families, nranks, "auto")
        cost = plan_cost(graph, build_plan(graph, strategy, nranks, cache=cache), machine)
        priced[(x, y)] = cost.unit_seconds()
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
    path = min(best[-1].values(), key=lambda item: item[0])[1]
    families = [FAMILIES[q] for q in path]
    strategy = _strategy(units, families, nranks, "auto")
    note = "exact DP over all family pairs"
    if len(priced) < k * k:
        note = f"time limit: DP over {len(priced)} of {k * k} family pairs"
    data = priced[(0, 0)]
    choices = []
    for i, (unit, q) in enumerate(zip(units, path)):
        prev = path[i - 1] if i else None
        choices.append(
            Choice(
                unit.name,
                FAMILIES[q],
                strategy.unit_grids[unit.name],
                unit_cost(i, prev, q),
                data.get(unit.name, 0.0),
            )
        )
    return SearchResult(strategy, choices, len(priced), k * k, note)


def evaluate(graph: TaskGraph, strategy: Strategy, nranks: int, machine: Machine) -> PlanCost:
    return plan_cost(graph, build_plan(graph, strategy, nranks), machine)
