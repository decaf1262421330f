"""`auto`'s fallback where no DP tabulates: a bounded local search over assignments of families.
It starts from the best uniform family (the three built-ins first, whatever the time limit),
then visits the units, costliest first, trying each other family for that unit alone and keeping
a change when the step it predicts is faster and fits in memory, until a pass changes nothing or
the time limit passes. It can stop at a local optimum.

An assignment is priced by `RowPricer` where the units' rows can be priced
(`transitions.UnitPricer`) but their DP would tabulate too wide a frontier
(`frontier_dp.FrontierTooWide`: Inception's and DenseNet's modules, whose branches read one
input and concatenate): the sum of its units' rows, each priced once, is the cost model's step
of its whole plan, and a change of one unit's family prices only the rows that depend on that
unit, and not even those where the unit's own row on the new grid and the others' bounds with the
unit hidden (`UnitPricer.bound`, once for all the unit's families) already add up to more than
the rows now (`RowPricer.cannot_improve`: where the current plan fits, such a change is never
kept, so the search goes the same way; Inception v2 on 64 ranks prices 3,207 rows, 5,772
before). Elsewhere (a task on a unit's grid that another unit's row cannot replay: `NotAChain`)
`PlanPricer` plans and costs each assignment whole.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from partitioner.accounting import fits
from partitioner.cost import step_seconds, task_costs, unit_seconds
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import build_plan
from partitioner.search import families
from partitioner.search.transitions import RowCost, UnitPricer, assignment_cost
from partitioner.strategy import BUILTIN, Grid, Strategy, Unit


@dataclass(frozen=True)
class Priced:
    """What the search keeps of a costed assignment."""

    unit_seconds: dict[str, float]
    step_seconds: float
    feasible: bool


class FamilyPricer:
    """Prices strategies given as one family per unit, each distinct set of grids once
    (`_price`, which the pricers below define)."""

    def __init__(self, graph: TaskGraph, units: list[Unit], nranks: int, machine: Machine):
        self.graph, self.units, self.nranks, self.machine = graph, units, nranks, machine
        self._found: dict[tuple[Grid, ...], Priced] = {}
        #: (unit index, family) -> the unit's grid under it
        self.grid_of, _ = families.grid_options(units, nranks)
        #: whether an assignment priced did not fit in memory (had none, the search would have
        #: gone the same way with no limit on memory)
        self.met_memory_limit = False

    def grids(self, chosen: list[str]) -> tuple[Grid, ...]:
        """Each unit's grid under its family in `chosen`."""
        return tuple(self.grid_of[(i, f)] for i, f in enumerate(chosen))

    def strategy(self, chosen: list[str]) -> Strategy:
        """The strategy giving each unit the grid of its family in `chosen`."""
        return self._strategy(self.grids(chosen))

    def _strategy(self, grids: tuple[Grid, ...]) -> Strategy:
        return Strategy("auto", {u.name: g for u, g in zip(self.units, grids)})

    def price(self, chosen: list[str]) -> Priced:
        key = self.grids(chosen)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = self._price(key)
            self.met_memory_limit |= not found.feasible
        return found

    def _price(self, grids: tuple[Grid, ...]) -> Priced:
        raise NotImplementedError

    def cannot_improve(self, chosen: list[str], i: int, family: str, best: Priced) -> bool:
        """Whether `chosen` with unit i's family changed to `family` is known to take longer
        than `best` (`chosen`'s price, which fits in memory) without pricing it: never known
        here; `RowPricer` bounds the rows that change."""
        return False

    @property
    def priced(self) -> int:
        return len(self._found)


class PlanPricer(FamilyPricer):
    """Each assignment's whole plan, built and costed."""

    def __init__(self, graph: TaskGraph, units: list[Unit], nranks: int, machine: Machine):
        super().__init__(graph, units, nranks, machine)
        self.cache = PieceCache(graph)

    def _price(self, grids: tuple[Grid, ...]) -> Priced:
        plan = build_plan(self.graph, self._strategy(grids), self.nranks, cache=self.cache)
        costs = task_costs(self.graph, plan, self.machine)
        return Priced(
            unit_seconds(costs),
            step_seconds(costs),
            fits(self.graph, plan, self.machine.buffer_capacity),
        )


class RowPricer(FamilyPricer):
    """Each assignment by its units' rows (`UnitPricer.factor`, each row once) and the rows of no
    unit (`UnitPricer.constant`): seconds and memory as its whole plan's."""

    def __init__(self, rows: UnitPricer):
        super().__init__(rows.graph, list(rows.units), rows.nranks, rows.machine)
        self.rows = rows
        self.capacity = rows.machine.buffer_capacity
        self._fixed = rows.constant()
        self._table: dict[tuple, RowCost] = {}
        #: per unit, the rows a change of its grid changes: those whose scope holds it
        self._changing = [
            [r for r, scope in enumerate(rows.scopes) if i in scope] for i in range(len(self.units))
        ]

    def memory_aside(self) -> RowPricer:
        """A pricer of the same rows (priced once for both) with no limit on memory."""
        other = copy.copy(self)
        other._found, other.capacity, other.met_memory_limit = {}, math.inf, False
        return other

    @property
    def rows_priced(self) -> int:
        return len(self._table)

    def _row(self, i: int, grids: tuple[Grid, ...]) -> RowCost:
        scope = self.rows.scopes[i]
        key = (i, tuple(grids[j] for j in scope))
        row = self._table.get(key)
        if row is None:
            row = self._table[key] = self.rows.factor(i, dict(zip(scope, key[1])))
        return row

    def cannot_improve(self, chosen: list[str], i: int, family: str, best: Priced) -> bool:
        """The rows a change of unit i's grid changes (its own and those that depend on it):
        its own priced on the new grid (its computation alone first, `compute_bound`, which
        may settle it unpriced), each other's bound with unit i hidden (below the row whatever
        unit i's grid, so found once for all of unit i's families) or its price where known;
        where they add up to more than those rows now do, by more than the rounding of a
        step's sum, the change takes longer. The search then goes the same way, pricing fewer
        rows (Inception's modules: a unit's output read by four branches)."""
        grids = self.grids(chosen)
        trial = grids[:i] + (self.grid_of[(i, family)],) + grids[i + 1 :]
        margin = ROUNDING * best.step_seconds
        now = least = 0.0
        own = None  # unit i's row on the new grid, where not priced yet
        for r in self._changing[i]:
            now += self._row(r, grids).seconds
            known = self._table.get((r, tuple(trial[j] for j in self.rows.scopes[r])))
            if known is not None:
                least += known.seconds
            elif r == i:
                own = self.rows.compute_bound(i, trial[i])
                least += own
            else:
                others = {j: trial[j] for j in self.rows.deps[r] if j != i}
                least += self.rows.bound(r, trial[r], others)
        if own is None or least - now > margin:
            return least - now > margin
        return least - own + self._row(i, trial).seconds - now > margin

    def _price(self, grids: tuple[Grid, ...]) -> Priced:
        rows = [self._row(i, grids) for i in range(len(self.units))]
        seconds, fit = assignment_cost(rows, self._fixed.memory, self.capacity)
        by_unit = {u.name: row.seconds for u, row in zip(self.units, rows)}
        return Priced(by_unit, seconds + self._fixed.seconds, fit)


#: how far, relative to a step, the rows a change makes may sum above the rows it replaces
#: and the step still come out shorter in floating point: far above the rounding of a sum of
#: a few thousand rows (`cannot_improve`)
ROUNDING = 1e-9


def _rank(cost: Priced) -> tuple[bool, float]:
    """Sort key: plans that fit in memory first, then by predicted step."""
    return (not cost.feasible, cost.step_seconds)


def local_search(pricer: FamilyPricer, deadline: float) -> tuple[list[str], str]:
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
            grid = pricer.grid_of[(i, current[i])]
            for family in families.FAMILIES:
                if time.monotonic() > deadline:
                    return current, f"time limit: local search, {pricer.priced} plans priced"
                if pricer.grid_of[(i, family)] == grid:
                    continue
                if best.feasible and pricer.cannot_improve(current, i, family, best):
                    continue
                trial = current[:i] + [family] + current[i + 1 :]
                cost = pricer.price(trial)
                if _rank(cost) < _rank(best):
                    current, best, changed = trial, cost, True
                    grid = pricer.grid_of[(i, family)]
        if not changed:
            return current, (
                f"not a chain: local search converged after {passes} passes, "
                f"{pricer.priced} plans priced"
            )
    return current, f"time limit: local search, {pricer.priced} plans priced"
