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
prices 259 of the 766 transitions (348 before a bound counted its input's least fetch over
the predecessor's grids), on ResNet-50 from the zoo at 64 ranks 896 rows (2,021 before), on
DenseNet-121 4,450 (6,453). When the time limit (checked between rounds) runs out first,
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
does. One DP serves both (`_lazy_dp`): each row is a factor over its *scope* (the unit and those
it depends on; on a chain, its predecessor), and `frontier_dp.FrontierDP` tabulates the
*frontier*, the units some later row still depends on (on a chain the unit being chosen, on
ResNet a block's input and the unit being chosen), so the lazy DP is exact on any graph. A row
that depends on several units gets one more bound between its own and its price: the row with one
of their grids known and the others hidden, for each of them (`UnitPricer.bound` with `known`),
the cell taking the largest. ResNet-18's shortcut convolutions depend on four units, 13,824
combinations each: without those bounds the DP priced 9,730 rows in 3,228 rounds at 64 ranks,
with them 2,468 in 202 (search 8.2 s → 3.3 s). Only where the frontier would be too wide to
tabulate (`FRONTIER_LIMIT`: Inception's modules) does `auto` fall back to a local search, over
assignments priced by the same rows (`local.RowPricer`), and over whole plans only where the rows
cannot be priced apart (`local.py`).

The pieces of the grids `auto` chose are kept for the graph's plans (`pieces.graph_pieces`),
which `build_plan` reuses. Planning at 1024 ranks (batch 256; `bench/planning.py`, CPU seconds on the
2-core development machine, search and final plan): seed-lcn 0.4 s (7 s when every family pair
was priced as whole plans), vgg19 1.5 s (over a minute then, cut at the 30 s default limit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from legion_nn.cycles import no_cycle_collection
from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.pieces import keep_pieces
from partitioner.plan import task_rows
from partitioner.search import families
from partitioner.search.coupling import is_chain
from partitioner.search.frontier_dp import INF, FrontierDP, FrontierTooWide
from partitioner.search.local import FamilyPricer, PlanPricer, RowPricer, local_search
from partitioner.search.transitions import NotAChain, RowCost, UnitPricer, assignment_cost
from partitioner.strategy import (
    BUILTIN,
    Grid,
    Strategy,
    find_units,
)


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
    #: rows priced (the DP; see `transitions.py`)
    transitions_priced: int = 0
    #: the DP knows no faster assignment under the cost model, memory aside: it did not trade
    #: seconds for memory (where the time limit stopped it, among the rows it priced)
    fastest: bool = False
    #: the cost model's step (`cost.plan_cost`'s bulk-synchronous seconds) of the chosen grids
    #: (`"auto"`) and of each built-in family the DP priced whole, where the DP prices rows
    bulk_seconds: dict[str, float] = field(default_factory=dict)
    #: the search would choose the same grids with no limit on memory: a DP's `fastest`, a
    #: local search that priced no assignment too large to fit
    memory_aside: bool = False
    #: the same search with no limit on memory, where it met one and repeated it on the rows it
    #: had priced (the local search by rows); None: not repeated
    unlimited: SearchResult | None = None


def auto(graph: TaskGraph, nranks: int, machine: Machine, time_limit: float = 30.0) -> SearchResult:
    units = find_units(graph)
    deadline = time.monotonic() + time_limit
    if units:
        chain = is_chain(graph, units, task_rows(graph))
        try:
            with no_cycle_collection():
                rows = UnitPricer(graph, units, nranks, machine)
                try:
                    return _lazy_dp(rows, deadline, chain)
                except FrontierTooWide:
                    return _local(RowPricer(rows), deadline)
        except NotAChain:
            pass
    return _local(PlanPricer(graph, units, nranks, machine), deadline)


def _local(pricer: FamilyPricer, deadline: float) -> SearchResult:
    """The local search's result (`local.py`); priced by rows (`RowPricer`), its grids' pieces
    are kept as a DP's are, and its bulk-synchronous seconds given as a DP gives them."""
    units = pricer.units
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
    aside = not pricer.met_memory_limit
    if not isinstance(pricer, RowPricer):
        return SearchResult(strategy, choices, pricer.priced, note, memory_aside=aside)
    result = _dp_result(
        pricer.rows, [strategy.unit_grids[u.name] for u in units], choices, note,
        pricer.rows_priced, False,
    )  # fmt: skip
    result.plans_priced, result.memory_aside = pricer.priced, aside
    for family in BUILTIN:
        result.bulk_seconds[family] = pricer.price([family] * len(units)).step_seconds
    result.bulk_seconds["auto"] = pricer.price(chosen).step_seconds
    if not aside:
        result.unlimited = _local(pricer.memory_aside(), deadline)
    return result


def _dp_result(
    pricer: UnitPricer,
    chosen: list[Grid],
    choices: list[Choice],
    note: str,
    priced: int,
    fastest: bool,
) -> SearchResult:
    """A DP's result: the strategy of the grids `chosen`, their pieces kept for the graph's
    plans (`pieces.keep_pieces`); `fastest`: the DP knows no faster assignment, memory aside."""
    strategy = Strategy("auto", {u.name: q for u, q in zip(pricer.units, chosen)})
    keep_pieces(pricer.cache, strategy.task_grids(pricer.graph))
    return SearchResult(strategy, choices, 0, note, priced, fastest, memory_aside=fastest)


def _lazy_dp(pricer: UnitPricer, deadline: float, chain: bool) -> SearchResult:
    """The lazy DP of the module docstring over each row's *scope*, the unit and the units its
    row depends on (`UnitPricer.deps`: on a chain, its predecessor), by `frontier_dp.FrontierDP`;
    `chain` words the note."""
    units, nranks = pricer.units, pricer.nranks
    grid_of, options = families.grid_options(units, nranks)
    grids = [list(found) for found in options]
    index = [{g: k for k, g in enumerate(found)} for found in grids]
    scopes = pricer.scopes
    shapes = [tuple(len(grids[j]) for j in scope) for scope in scopes]
    dp = FrontierDP(scopes, [len(found) for found in grids])
    fixed = pricer.constant()  # the rows of no unit, and the memory no unit's grid sets
    constant = fixed.memory
    capacity = pricer.machine.buffer_capacity
    table: dict[tuple, RowCost] = {}
    priced = [np.zeros(shape, bool) for shape in shapes]
    #: per unit, the lazy DP's values over its scope's grids: a row's price where priced, else
    #: the tightest of its bounds found
    lower = [
        np.broadcast_to(
            np.array([pricer.compute_bound(i, q) for q in grids[i]]).reshape(
                [len(grids[i]) if j == i else 1 for j in scope]
            ),
            shape,
        ).copy()
        for i, (scope, shape) in enumerate(zip(scopes, shapes))
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

    def refinements(i: int, q: Grid, assignment: tuple) -> list[tuple]:
        """The `known` grids of the bounds the lazy DP finds next for unit i's row on grid q
        under `assignment` before pricing it (none: price it): the row's bound with every
        dependency hidden, then, where it has several, with one known at a time (a residual
        block's shortcut depends on four units' grids: bounds of one known grid each settle most
        of their combinations without pricing them)."""
        if (i, q, ()) not in refined:
            return [()]
        if len(pricer.deps[i]) < 2:
            return []
        known = [((j, g),) for j, g in zip(scopes[i], assignment) if j != i]
        return [k for k in known if (i, q, k) not in refined]

    def path_of(solution: list[int]) -> list[Grid]:
        return [grids[i][k] for i, k in enumerate(solution)]

    def uniform(family: str) -> list[Grid]:
        return [grid_of[(i, family)] for i in range(len(units))]

    def complete(path: list[Grid]) -> bool:
        return all(key_of(i, path) in table for i in range(len(units)))

    def cost(path: list[Grid]) -> tuple[float, bool]:
        return assignment_cost(
            [table[key_of(i, path)] for i in range(len(units))], constant, capacity
        )

    def exact() -> list[np.ndarray]:
        return [np.where(done, value, INF) for done, value in zip(priced, lower)]

    for family in BUILTIN:  # whatever the time limit
        path = uniform(family)
        for i in range(len(units)):
            price(key_of(i, path))
    # Price lazily: a row not yet priced counts at its tightest bound; the cheapest assignment
    # under those values has its rows bounded tighter, then priced, until it needs none
    # unpriced. It is then the cheapest under the exact values too, as every bound is below
    # its price.
    proven = False
    changed: set[int] | None = None  # the first solve works out every table
    while time.monotonic() <= deadline:
        solution = dp.solve(lower, changed)
        changed = set()
        path = None if solution is None else path_of(solution)
        missing = [] if path is None else [
            key_of(i, path) for i in range(len(units)) if key_of(i, path) not in table
        ]  # fmt: skip
        if not missing:
            proven = True
            break
        for i, assignment in missing:
            changed.add(i)
            q = assignment[scopes[i].index(i)]
            todo = refinements(i, q, assignment)
            for known in todo:
                refine(i, q, known)
            if not todo:
                price((i, assignment))

    solution = dp.solve(exact())
    candidates = [] if solution is None else [path_of(solution)]
    fits_cheapest = bool(candidates) and cost(candidates[0])[1]
    if not fits_cheapest:
        # the fastest assignment does not fit: price what is left, while the time lasts, then
        # trade seconds for memory, row by row, with weights growing until an assignment fits
        for i, scope in enumerate(scopes):
            for at in np.argwhere(~priced[i]).tolist():
                if time.monotonic() > deadline:
                    break
                price((i, tuple(grids[j][k] for j, k in zip(scope, at))))
        peaks = [np.zeros(shape) for shape in shapes]
        for key, row in table.items():
            peaks[key[0]][cell(key)] = float(row.memory.max(initial=0))
        scale = max((r.seconds for r in table.values()), default=1.0) / max(capacity, 1.0)
        values = exact()
        for k in range(-8, 40):
            penalty = scale * 2.0**k
            solution = dp.solve([v + penalty * m for v, m in zip(values, peaks)])
            if solution is not None and cost(path_of(solution))[1]:
                candidates.append(path_of(solution))
                break
    uniforms = [uniform(f) for f in families.FAMILIES if complete(uniform(f))]
    feasible = [path for path in candidates + uniforms if cost(path)[1]]
    # where nothing fits, the fastest of the uniform assignments (which `memory_fit` shards)
    chosen = min(feasible or uniforms, key=lambda path: cost(path)[0])
    if proven:
        note = "exact DP over " + ("all family pairs" if chain else "the rows' dependencies")
    else:
        total = sum(int(np.prod(shape)) for shape in shapes)
        note = f"time limit: DP over {len(table)} of {total} rows"
    if not feasible:
        note += "; nothing fits in memory"
    data = uniform("data")
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
    result = _dp_result(pricer, chosen, choices, note, len(table), fits_cheapest)
    for family in BUILTIN:
        result.bulk_seconds[family] = cost(uniform(family))[0] + fixed.seconds
    result.bulk_seconds["auto"] = cost(chosen)[0] + fixed.seconds
    return result
