"""`auto`: per-unit grids, by dynamic programming over the units' rows.

Each unit is offered the same few *families* of grids (`families.py`: data, model, spatial,
their mixtures and the reduction splits); families giving a unit the same grid count once.

On a chain (`coupling.is_chain`; networks without branches lower to chains) a unit's table row (its tasks,
their transfers and reductions, its parameters' updates) costs what it costs because of two grids
only, its own and its predecessor's: a unit reads only its predecessor's output and reduces only
into its predecessor's gradient. The search prices *transitions*, (unit i, grid p of unit i − 1,
grid q of unit i), each by `transitions.UnitPricer`, which replays just the tasks the row
depends on with the planner's own steps and gets, float for float, the row's seconds in any whole
plan with those two grids, and the memory per rank the transition sets; the messages between two
different grids are priced dim by dim (`grid_loads.py`, `grid_combine.py`), not listed. A DP over
the transitions then finds the cheapest assignment of grids under the cost model.

Not every transition is priced. `UnitPricer.bound(i, q)` is a lower bound on unit i's row on
grid q whatever its predecessor's grid (the row without the messages that depend on that grid),
and `UnitPricer.compute_bound(i, q)` (its computation alone) a weaker one that costs almost
nothing. The transitions of the three built-in strategies (data, model, spatial) are priced
first, whatever the time limit; then the DP values each unpriced transition at its bound (the
weaker one until the row's bound was needed), the transitions of its cheapest assignment get
their row's bound or, already having it, their price, and so on until that assignment needs no
unpriced transition: it is then the cheapest under the exact prices too (every bound is below
its price), so the DP is exact ("exact DP over all family pairs"). On vgg19 at 1024 ranks it
prices 269 of the 766 transitions. When the time limit (checked between rounds) runs out first,
the DP uses the transitions priced so far. A transition whose row alone needs more memory than a
rank has is never chosen; when the cheapest assignment does not fit in memory as a whole (the
memory of an assignment is the sum of its transitions' terms, exactly that of its plan), every
transition is priced and the DP trades seconds for each row's peak memory, with weights growing
until an assignment fits, and the cheapest fitting one of that and the uniform families is
taken. So `auto` is never worse than the best of data, model and spatial that fits.

On other graphs (a residual block's add reading the block's input, a second head, BatchNorm's
statistics) a unit's row depends on the grids of the units in `UnitPricer.deps` (its
predecessor, the writers of what it reads, siblings that read the same tensor before it, the
readers of its homes), and `UnitPricer.factor` prices it given those, exactly as the whole plan
does. `frontier_dp.FrontierDP` then runs the same lazy DP over the *frontier*, the units some later row
still depends on (on ResNet a block's input and the unit being chosen), so it is exact too. A row
that depends on several units gets one more bound between its own and its price: the row with one
of their grids known and the others hidden, for each of them (`UnitPricer.bound` with `known`),
the cell taking the largest. ResNet-18's shortcut convolutions depend on four units, 13,824
combinations each: without those bounds the DP priced 9,730 rows in 3,228 rounds at 64 ranks,
with them 2,468 in 202 (search 8.2 s → 3.3 s). Only
where the frontier would be too wide to tabulate (`FRONTIER_LIMIT`) does `auto` fall back to
a local search over whole plans (`local.py`).

The strategy `auto` returns carries the pieces of the grids it chose (`Strategy.pieces`), which
`build_plan` reuses. Planning at 1024 ranks (batch 256; `bench/planning.py`, CPU seconds on the
2-core development machine, search and final plan): seed-lcn 0.4 s (7 s when every family pair
was priced as whole plans), vgg19 1.5 s (over a minute then, cut at the 30 s default limit).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise, product

import numpy as np

from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.pieces import chosen_pieces
from partitioner.plan import task_rows
from partitioner.search import families
from partitioner.search.coupling import is_chain
from partitioner.search.frontier_dp import INF, FrontierDP
from partitioner.search.local import PlanPricer, local_search
from partitioner.search.transitions import NotAChain, RowCost, UnitPricer
from partitioner.strategy import (
    BUILTIN,
    Grid,
    Strategy,
    find_units,
)

#: (unit index, predecessor's grid or None, the unit's grid)
Transition = tuple


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
    #: whole plans built and costed (the local search)
    plans_priced: int
    note: str
    #: unit transitions priced (the DP on chains; see `transitions.py`)
    transitions_priced: int = 0
    #: the DP proved this the cheapest assignment under the cost model, memory aside
    fastest: bool = False
    #: the cost model's step (`cost.plan_cost`'s bulk-synchronous seconds) of the chosen grids
    #: (`"auto"`) and of each built-in family the DP priced whole, where the DP prices rows
    bulk_seconds: dict[str, float] = field(default_factory=dict)


def auto(graph: TaskGraph, nranks: int, machine: Machine, time_limit: float = 30.0) -> SearchResult:
    units = find_units(graph)
    deadline = time.monotonic() + time_limit
    if units:
        chain = is_chain(graph, units, task_rows(graph))
        try:
            with _no_cycle_collection():
                pricer = UnitPricer(graph, units, nranks, machine)
                return (_chain_dp if chain else _dag_dp)(pricer, deadline)
        except NotAChain:
            pass
    pricer = PlanPricer(graph, units, nranks, machine)
    chosen, note = local_search(pricer, deadline)
    strategy = pricer.strategy(chosen)
    final = pricer.price(chosen).unit_seconds
    data = pricer.price(["data"] * len(units)).unit_seconds
    choices = [
        Choice(
            u.name, f, strategy.unit_grids[u.name], final.get(u.name, 0.0), data.get(u.name, 0.0)
        )
        for u, f in zip(units, chosen)
    ]
    return SearchResult(strategy, choices, pricer.priced, note)


@contextmanager
def _no_cycle_collection():
    """The DP allocates some 10⁵ small objects (rects, dicts, tuples) and keeps many alive in
    its tables; none forms a reference cycle, yet each allocation burst makes Python's cycle
    collector walk them all. It is paused for the search and resumed after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dp_result(
    pricer: UnitPricer,
    chosen: list[Grid],
    choices: list[Choice],
    note: str,
    priced: int,
    fastest: bool,
) -> SearchResult:
    """A DP's result: the strategy of the grids `chosen`, carrying their pieces; `fastest`:
    the DP proved them the cheapest assignment, memory aside."""
    strategy = Strategy("auto", {u.name: q for u, q in zip(pricer.units, chosen)})
    pieces = chosen_pieces(pricer.cache, strategy.task_grids(pricer.graph))
    object.__setattr__(strategy, "pieces", pieces)
    return SearchResult(strategy, choices, 0, note, priced, fastest)


def _path_cost(rows: list[RowCost], constant: np.ndarray, capacity: float) -> tuple[float, bool]:
    """The seconds of an assignment's rows, and whether its memory per rank fits (settled by
    the rows' memory bounds where they fit)."""
    seconds = sum(r.seconds for r in rows)
    if (constant + sum(r.memory_bound for r in rows)).max(initial=0) <= capacity:
        return seconds, True
    return seconds, bool((constant + sum(r.memory for r in rows)).max(initial=0) <= capacity)


def _chain_dp(pricer: UnitPricer, deadline: float) -> SearchResult:
    units, nranks = pricer.units, pricer.nranks
    grid_of, options = families.grid_options(units, nranks)
    grids = [list(found) for found in options]
    total = len(grids[0]) + sum(len(a) * len(b) for a, b in pairwise(grids))
    table: dict[Transition, RowCost] = {}
    fits: dict[Transition, bool] = {}
    constant = pricer.constant().memory
    capacity = pricer.machine.memory_bytes

    predecessors = [[None]] + grids[:-1]
    lower: list[np.ndarray] = []  # per unit, the lazy DP's values by (predecessor's, own grid)

    def price(key: Transition) -> None:
        if key not in table:
            table[key] = found = pricer.transition(*key)
            fits[key] = found.fits(constant, capacity)
            if lower:
                i, p, q = key
                lower[i][predecessors[i].index(p), grids[i].index(q)] = seconds(key)

    def family_pair(x: str, y: str) -> None:
        for i in range(len(units)):
            price((i, grid_of[(i - 1, x)] if i else None, grid_of[(i, y)]))

    def seconds(key: Transition) -> float:
        """A priced row's seconds (infinite where it alone does not fit); None: unpriced."""
        if key not in table:
            return None
        return table[key].seconds if fits[key] else INF

    def values(value) -> list[np.ndarray]:
        """`value(transition)` of every transition, per unit a (predecessor's, own) matrix."""
        return [
            np.array([[value((i, p, q)) for q in grids[i]] for p in predecessors[i]])
            for i in range(len(units))
        ]

    def best_path(matrices: list[np.ndarray]) -> list[Grid] | None:
        """The assignment of grids minimising the sum of the transitions' values (`values`);
        on ties the first predecessor's and the first grid, in their families' order."""
        cost = matrices[0][0]
        back = []
        for matrix in matrices[1:]:
            total = cost[:, None] + matrix
            best = total.argmin(axis=0)
            cost = total[best, np.arange(total.shape[1])]
            back.append(best)
        chosen = [int(cost.argmin())]
        if cost[chosen[0]] == INF:
            return None
        for best in reversed(back):
            chosen.append(int(best[chosen[-1]]))
        return [grids[i][k] for i, k in enumerate(reversed(chosen))]

    refined: set[tuple[int, Grid]] = set()  # (unit, grid) whose `bound` replaced its compute_bound

    def refine(i: int, q: Grid) -> None:
        refined.add((i, q))
        k = grids[i].index(q)
        for row, p in enumerate(predecessors[i]):
            if (i, p, q) not in table:
                lower[i][row, k] = pricer.bound(i, q)

    def exact(key: Transition) -> float:
        found = seconds(key)
        return INF if found is None else found

    def keys(path: list[Grid]) -> list[Transition]:
        return [(i, path[i - 1] if i else None, q) for i, q in enumerate(path)]

    for family in BUILTIN:  # whatever the time limit
        family_pair(family, family)
    # Price lazily: a transition not yet priced counts at its lower bound; the cheapest
    # assignment under those values has its transitions priced, until it needs none unpriced.
    # It is then the cheapest under the exact values too, as every bound is below its price.
    lower.extend(
        values(
            lambda key: pricer.compute_bound(key[0], key[2]) if key not in table else seconds(key)
        )
    )
    proven = False
    while time.monotonic() <= deadline:
        path = best_path(lower)
        missing = [] if path is None else [k for k in keys(path) if k not in table]
        if not missing:
            proven = True
            break
        for key in missing:  # a bound a step tighter: the row's, then its price
            if (key[0], key[2]) in refined:
                price(key)
            else:
                refine(key[0], key[2])

    def cost(path: list[Grid]) -> tuple[float, bool]:
        return _path_cost([table[key] for key in keys(path)], constant, capacity)

    uniform = [
        [grid_of[(i, f)] for i in range(len(units))]
        for f in families.FAMILIES
        if all(k in table for k in keys([grid_of[(i, f)] for i in range(len(units))]))
    ]
    candidates = [path for path in [best_path(values(exact))] if path is not None]
    fits_cheapest = bool(candidates) and cost(candidates[0])[1]
    if not fits_cheapest:
        # the fastest assignment does not fit: price what is left, then trade seconds for
        # memory, row by row
        for x, y in product(families.FAMILIES, families.FAMILIES):
            if time.monotonic() > deadline:
                break
            family_pair(x, y)
        peak = {key: float(row.memory.max(initial=0)) for key, row in table.items()}
        scale = max((r.seconds for r in table.values()), default=1.0) / max(capacity, 1.0)
        for k in range(-8, 40):
            penalty = scale * 2.0**k
            path = best_path(values(lambda key, w=penalty: exact(key) + w * peak.get(key, 0.0)))
            if path is not None and cost(path)[1]:
                candidates.append(path)
                break
        candidates += uniform
    feasible = [path for path in candidates if cost(path)[1]]
    if feasible:
        chosen = min(feasible, key=lambda path: cost(path)[0])
    else:
        # nothing fits in memory: the fastest of the uniform assignments, infeasible
        chosen = min(uniform, key=lambda path: cost(path)[0])
    note = "exact DP over all family pairs"
    if not proven:
        note = f"time limit: DP over {len(table)} of {total} unit transitions"
    choices = []
    for i, (unit, q) in enumerate(zip(units, chosen)):
        p = chosen[i - 1] if i else None
        data_p = grid_of[(i - 1, "data")] if i else None
        data = table[(i, data_p, grid_of[(i, "data")])]
        choices.append(Choice(unit.name, options[i][q], q, table[(i, p, q)].seconds, data.seconds))
    result = _dp_result(pricer, chosen, choices, note, len(table), proven and fits_cheapest)
    fixed = pricer.constant().seconds
    for family in BUILTIN:
        path = [grid_of[(i, family)] for i in range(len(units))]
        if all(k in table for k in keys(path)):
            result.bulk_seconds[family] = cost(path)[0] + fixed
    result.bulk_seconds["auto"] = cost(chosen)[0] + fixed
    return result


def _dag_dp(pricer: UnitPricer, deadline: float) -> SearchResult:
    """`auto` on a graph that is not a chain: the lazy DP of `_chain_dp` over each row's
    dependencies (`frontier_dp.FrontierDP`), each row priced by `UnitPricer.factor` given the
    grids of the units it depends on, as the whole plan prices it."""
    units, nranks = pricer.units, pricer.nranks
    grid_of, options = families.grid_options(units, nranks)
    grids = [list(found) for found in options]
    index = [{g: k for k, g in enumerate(found)} for found in grids]
    scopes = [tuple(sorted((*pricer.deps[i], i))) for i in range(len(units))]
    dp = FrontierDP(scopes, [len(found) for found in grids])
    constant = pricer.constant().memory
    capacity = pricer.machine.memory_bytes
    table: dict[tuple, RowCost] = {}
    priced = [np.zeros([len(grids[j]) for j in scope], bool) for scope in scopes]
    lower = [
        np.broadcast_to(
            np.array([pricer.compute_bound(i, q) for q in grids[i]]).reshape(
                [len(grids[i]) if j == i else 1 for j in scope]
            ),
            [len(grids[j]) for j in scope],
        ).copy()
        for i, scope in enumerate(scopes)
    ]
    #: (unit, grid, known grids of its dependencies) whose bound raised its cells
    refined: set[tuple] = set()

    def key_of(i: int, path: list[Grid]) -> tuple:
        return (i, tuple(path[j] for j in scopes[i]))

    def cell(key: tuple) -> tuple[int, ...]:
        i, assignment = key
        return tuple(index[j][g] for j, g in zip(scopes[i], assignment))

    def price(key: tuple) -> None:
        if key in table:
            return
        i, assignment = key
        table[key] = found = pricer.factor(i, dict(zip(scopes[i], assignment)))
        lower[i][cell(key)] = found.seconds if found.fits(constant, capacity) else INF
        priced[i][cell(key)] = True

    def refine(i: int, q: Grid, known: tuple[tuple[int, Grid], ...] = ()) -> None:
        """Raise the unpriced cells of unit i on grid q (and on the grids `known` of some of
        its dependencies) to the row's bound with the others hidden."""
        refined.add((i, q, known))
        bound = pricer.bound(i, q, dict(known))
        fixed = dict(known) | {i: q}
        where = tuple(
            slice(index[j][fixed[j]], index[j][fixed[j]] + 1) if j in fixed else slice(None)
            for j in scopes[i]
        )
        view = lower[i][where]  # a view: the cells are raised in place
        view[...] = np.where(priced[i][where], view, np.maximum(view, bound))

    def next_bound(key: tuple) -> tuple | None:
        """The refinement the lazy DP makes next for `key` before pricing it, if any: the row's
        bound with every dependency hidden, then, where it has several, with one known at a
        time (a residual block's shortcut depends on four units' grids: bounds of one known
        grid each settle most of their combinations without pricing them)."""
        i, assignment = key
        q = assignment[scopes[i].index(i)]
        if (i, q, ()) not in refined:
            return (i, q, ())
        if len(pricer.deps[i]) < 2:
            return None
        todo = [
            ((j, g),)
            for j, g in zip(scopes[i], assignment)
            if j != i and (i, q, ((j, g),)) not in refined
        ]
        return (i, q, todo) if todo else None

    def path_of(solution: list[int]) -> list[Grid]:
        return [grids[i][k] for i, k in enumerate(solution)]

    for family in BUILTIN:  # whatever the time limit
        uniform = [grid_of[(i, family)] for i in range(len(units))]
        for i in range(len(units)):
            price(key_of(i, uniform))
    proven = False
    changed: set[int] | None = None  # the first solve works out every table
    while time.monotonic() <= deadline:
        solution = dp.solve(lower, changed)
        changed = set()
        path = None if solution is None else path_of(solution)
        missing = (
            []
            if path is None
            else [key_of(i, path) for i in range(len(units)) if key_of(i, path) not in table]
        )
        if not missing:
            proven = True
            break
        for key in missing:
            changed.add(key[0])
            step = next_bound(key)
            if step is None:
                price(key)
            elif not step[2]:
                refine(*step)
            else:
                for known in step[2]:
                    refine(step[0], step[1], known)

    def cost(path: list[Grid]) -> tuple[float, bool]:
        return _path_cost([table[key_of(i, path)] for i in range(len(units))], constant, capacity)

    exact = [np.where(done, value, INF) for done, value in zip(priced, lower)]
    candidates = []
    solution = dp.solve(exact)
    if solution is not None:
        candidates.append(path_of(solution))
    fits_cheapest = bool(candidates) and cost(candidates[0])[1]
    for family in families.FAMILIES:
        uniform = [grid_of[(i, family)] for i in range(len(units))]
        if all(key_of(i, uniform) in table for i in range(len(units))):
            candidates.append(uniform)
    feasible = [p for p in candidates if cost(p)[1]]
    chosen = min(feasible or candidates, key=lambda p: cost(p)[0])
    note = "exact DP over the rows' dependencies"
    if not proven:
        note = f"time limit: DP over {len(table)} priced rows"
    if not feasible:
        note += "; nothing fits in memory"
    data = [grid_of[(i, "data")] for i in range(len(units))]
    choices = [
        Choice(
            unit.name,
            options[i][q],
            q,
            table[key_of(i, chosen)].seconds,
            table[key_of(i, data)].seconds,
        )
        for i, (unit, q) in enumerate(zip(units, chosen))
    ]
    return _dp_result(pricer, chosen, choices, note, len(table), proven and fits_cheapest)
