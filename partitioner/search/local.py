"""`auto`'s fallback where no DP tabulates (a frontier too wide, `frontier_dp.FRONTIER_LIMIT`):
a bounded local search over whole plans. It starts from the best uniform family (the three
built-ins first, whatever the time limit), then visits the units, costliest first, trying each
other family for that unit alone and keeping a change when the whole plan predicts a faster step
that fits in memory, until a pass changes nothing or the time limit passes. It can stop at a
local optimum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from partitioner.accounting import fits
from partitioner.cost import step_seconds, task_costs, unit_seconds
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import build_plan
from partitioner.search import families
from partitioner.strategy import BUILTIN, Grid, Strategy, Unit


@dataclass(frozen=True)
class Priced:
    """What the search keeps of a costed plan."""

    unit_seconds: dict[str, float]
    step_seconds: float
    feasible: bool


class PlanPricer:
    """Plans and costs strategies given as one family per unit, each distinct set of grids once."""

    def __init__(self, graph: TaskGraph, units: list[Unit], nranks: int, machine: Machine):
        self.graph, self.units, self.nranks, self.machine = graph, units, nranks, machine
        self.cache = PieceCache(graph)
        self._found: dict[tuple[Grid, ...], Priced] = {}

    def strategy(self, chosen: list[str]) -> Strategy:
        """The strategy giving each unit the grid of its family in `chosen`."""
        grids = {
            u.name: families.family_grid(u, f, self.nranks) for u, f in zip(self.units, chosen)
        }
        return Strategy("auto", grids)

    def price(self, chosen: list[str]) -> Priced:
        strategy = self.strategy(chosen)
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


def local_search(pricer: PlanPricer, deadline: float) -> tuple[list[str], str]:
    n = len(pricer.units)
    pure = []
    for index, family in enumerate(families.FAMILIES):
        if index >= len(BUILTIN) and time.monotonic() > deadline:
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
            grid = families.family_grid(pricer.units[i], current[i], pricer.nranks)
            for family in families.FAMILIES:
                if time.monotonic() > deadline:
                    return current, f"time limit: local search, {pricer.priced} plans priced"
                if families.family_grid(pricer.units[i], family, pricer.nranks) == grid:
                    continue
                trial = current[:i] + [family] + current[i + 1 :]
                cost = pricer.price(trial)
                if _rank(cost) < _rank(best):
                    current, best, changed = trial, cost, True
                    grid = families.family_grid(pricer.units[i], family, pricer.nranks)
        if not changed:
            return current, (
                f"not a chain: local search converged after {passes} passes, "
                f"{pricer.priced} plans priced"
            )
    return current, f"time limit: local search, {pricer.priced} plans priced"
