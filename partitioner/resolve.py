"""A `--strategy` argument as the commands take it: `data`, `model`, `spatial`, `auto` or a file.

A strategy file (`strategy_file`) names a grid per unit. `auto` searches under the cost model of a machine
(`search.auto`) and also returns why it chose each grid. `legion-nn partition` and
`legion-nn render --ranks` resolve the argument here, and `legion-nn train` chooses with it
(`strategy_chooser`, which checks the argument before MPI starts), so all mean the same plan by it.

A graph whose tasks can be cut over the batch only, as an imported graph's are, has one plan to
offer: `data`, which `auto` then is (with a note saying so), while `model` and `spatial` are
refused with one line rather than quietly planned as `data`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.micro_batches import stages_of
from legion_nn.op_records import has_access_map
from partitioner.cost import bulk_seconds, step_seconds, task_costs, unit_seconds
from partitioner.machine import Machine
from partitioner.pieces import graph_pieces
from partitioner.plan import Plan, build_plan
from partitioner.search.auto import SearchResult, auto
from partitioner.search.memory_fit import (
    STEP_WITHIN,
    ComparedFn,
    Fitted,
    LowerFn,
    NoFit,
    PeakFn,
    StepFn,
    SumsFn,
    fit,
    least_step,
)
from partitioner.search.stages import PipelineChoice, PipelineSearch, choose_pipeline
from partitioner.strategy import (
    BUILTIN,
    Strategy,
    builtin,
    check_param_homes,
    find_units,
    with_homes,
)
from partitioner.strategy_file import check_strategy_name, grids_strategy, read_grids

#: told, before a search begins, the strategies whose plans it will ask a `StepFn` and a
#: `PeakFn` about on so many ranks; told again once it is done, those it still may ask about,
#: and (`placing`) those whose step it simulates next, before their peak (see `StepModel.foresee`)
ForeseeFn = Callable[..., None]
#: every job's value (calls without arguments, by key), worked out at once where the caller
#: has idle cores (`StepModel.share_out`)
ShareFn = Callable[[Mapping[Hashable, Callable[[], Any]]], dict[Hashable, Any]]


def check_plannable(graph: TaskGraph) -> None:
    """Every task needs an access map to be cut into pieces (a hand-edited graph may lack one)."""
    for task in graph.tasks:
        if not has_access_map(task.op, task.phase):
            raise LegionNNError(
                f"task {task.name} (op {task.op}, {task.phase}) has no access map, so "
                f"{graph.network or 'the graph'} cannot be partitioned"
            )


def batch_only(graph: TaskGraph) -> bool:
    """Whether no unit of `graph` can be cut along anything but the batch (dim 0)."""
    return all(set(unit.splittable) <= {0} for unit in find_units(graph))


def resolve_strategy(
    graph: TaskGraph,
    name: str,
    nranks: int,
    machine: Machine,
    time_limit: float,
    note: Callable[[str], None] | None = None,
    param_homes: str | None = None,
    peak: PeakFn | None = None,
    step: StepFn | None = None,
    lower: LowerFn | None = None,
    sums: SumsFn | None = None,
    foresee: ForeseeFn | None = None,
    share: ShareFn | None = None,
) -> tuple[Strategy, list[dict] | None]:
    """The strategy `name` stands for on `nranks` ranks with `--param-homes` (None: replicated),
    and auto's reasons (None otherwise); `note` hears why `auto` settled for `data` on a
    batch-only graph.

    With `step` (a plan's predicted step as `partition` reports it: the commands pass
    `runtime.step.simulator`'s), `auto` returns the plan of least predicted step among its
    search's and the built-ins' (`memory_fit.least_step`): the search adds up seconds per layer,
    which cannot see messages overlapping compute, and what auto optimises is then what
    `partition` prints.

    With `peak` (a plan's most bytes on any rank, as the runtime holds them: the commands pass
    `runtime.step.rank_memory`'s) and no `param_homes`, `auto` also chooses each parameter's home
    and fits the step in the machine's memory (`memory_fit.fit`): one line (`NoFit`) where
    nothing it tries fits. `lower` (a bound below `step` found without a rank's program: the
    commands pass `runtime.step.model.StepModel.step_lower_bound`) lets the fit leave out the
    plans that cannot be the fastest before placing their memory. `sums` (whether `step`
    compares the graph's plans on so many ranks by their bulk-synchronous sums, as the DP does:
    the commands pass `StepModel.step_is_sum`) lets a search that proved its grids' sum the least
    of all return them where they fit, as it does without `step`: no built-in's plan is made.
    `foresee` is told the built-ins' plans before the search begins, which `auto` with `step`
    compares with its search's grids where they may be faster (the commands pass
    `StepModel.foresee`, which works them out meanwhile on idle cores). `share` works out jobs
    at once on idle cores (the commands pass `StepModel.share_out`): `auto` in a pipeline's
    stages prices its built-ins with it."""
    deadline = time.monotonic() + time_limit
    if name == "auto" and stages_of(graph) > 1:
        strategy = _auto_in_stages(graph, nranks, machine, param_homes, step, lower, sums, share)
        return strategy, None
    homes = param_homes or "replicated"
    if name == "auto" and foresee is not None and step is not None and not batch_only(graph):
        foresee(
            graph, [with_homes(graph, builtin(graph, f, nranks), homes) for f in BUILTIN], nranks
        )
    strategy, why, searched = _resolve(graph, name, nranks, machine, time_limit, note)
    if searched is None or peak is None or param_homes is not None:
        chosen = with_homes(graph, strategy, homes)
        if searched is None or step is None:
            return chosen, why
        candidates = [chosen, *(with_homes(graph, builtin(graph, f, nranks), homes)
                                for f in BUILTIN)]  # fmt: skip
        index = _fastest(graph, candidates, nranks, machine, step, lower)
        picked = candidates[index]
        return picked, why if index == 0 else _reasons(graph, picked, nranks, machine, why)
    if (step is None or (sums is not None and sums(graph, nranks))) and searched.fastest:
        if foresee is not None:  # reported where it fits, the built-ins then not compared
            foresee(graph, [], nranks, placing=[strategy])
        if peak(graph, build_plan(graph, strategy, nranks)) <= machine.memory_bytes:
            return strategy, _reasons(graph, strategy, nranks, machine, why)  # nothing is faster
    if searched.memory_aside:
        fastest, reasons = strategy, list(why)
    elif searched.unlimited is not None:
        fastest, reasons = searched.unlimited.strategy, why + _choice_rows(searched.unlimited)
    else:
        # the grids of least seconds, memory aside, within what is left of the time limit
        room = replace(machine, rank_memory_gib=math.inf)
        unlimited = auto(graph, nranks, room, max(deadline - time.monotonic(), 1.0))
        fastest, reasons = unlimited.strategy, why + _choice_rows(unlimited)
    known = searched.bulk_seconds
    limit = STEP_WITHIN * known.get("auto", math.inf)
    skipped = {f: known[f] for f in BUILTIN if known.get(f, 0.0) > limit}
    candidates = [
        strategy,
        fastest,
        *(builtin(graph, f, nranks) for f in BUILTIN if f not in skipped),
    ]
    if foresee is not None:  # the fit's lead, placed first where `_within_reach` places it
        foresee(graph, candidates[2:], nranks, placing=[strategy])
    # the DP's count is above the placed buffers (`accounting`), so grids it found to fit fit
    # as placed, and where `fit` finds nothing, no grids the DP could find in less memory would
    fitted = _fit_near(graph, nranks, machine, candidates, skipped, peak, deadline, step, lower)
    return fitted.strategy, _reasons(graph, fitted.strategy, nranks, machine, reasons)


def _fit_near(
    graph: TaskGraph,
    nranks: int,
    machine: Machine,
    candidates: list[Strategy],
    skipped: dict[str, float],
    peak: PeakFn,
    deadline: float,
    step: StepFn | None,
    lower: LowerFn | None = None,
) -> Fitted:
    """`memory_fit.fit` of `candidates`, and of each `skipped` built-in (its bulk-synchronous
    seconds, which the search priced) only where it can matter: where nothing else fits, or
    where it is within `STEP_WITHIN` of the plan chosen. Exact: a plan more than `STEP_WITHIN`
    times slower than one that fits is never chosen (`memory_fit.least_step`), and sharding
    homes to fit never makes a plan faster; planning a large plan is what `fit` spends its time
    on (vgg19 on 1024 ranks: 0.9 s a candidate)."""
    try:
        fitted = fit(graph, nranks, machine, candidates, peak, deadline, step, lower)
    except NoFit:
        if not skipped:
            raise
        late = list(skipped)
    else:
        late = [f for f, seconds in skipped.items() if seconds <= STEP_WITHIN * fitted.seconds]
        if not late:
            return fitted
    more = [builtin(graph, f, nranks) for f in late]
    return fit(graph, nranks, machine, candidates + more, peak, deadline, step, lower)


def _reasons(
    graph: TaskGraph, strategy: Strategy, nranks: int, machine: Machine, why: list[dict]
) -> list[dict]:
    """`why` for the grids `fit` chose: the reasons of a search (`why`, rows of every search
    made) that chose the same grid for a layer, else the family's name and the cost model's
    seconds; each with the parameters the layer reads whose homes are sharded."""
    by_layer: dict[tuple[str, tuple[int, ...]], dict] = {}
    for row in why:
        by_layer.setdefault((row["layer"], tuple(row["grid"])), row)
    units = find_units(graph)
    seconds: dict[str, float] = {}
    data_seconds: dict[str, float] = {}
    if any((u.name, tuple(strategy.unit_grids[u.name])) not in by_layer for u in units):
        costs = task_costs(graph, build_plan(graph, strategy, nranks), machine)
        data = builtin(graph, "data", nranks)
        seconds = unit_seconds(costs)
        data_seconds = unit_seconds(task_costs(graph, build_plan(graph, data, nranks), machine))
    rows = []
    for unit in units:
        grid = list(strategy.unit_grids[unit.name])
        row = by_layer.get((unit.name, tuple(grid)))
        if row is None:
            row = {
                "layer": unit.name,
                "family": strategy.name,
                "grid": grid,
                "seconds": seconds.get(unit.name, 0.0),
                "data_seconds": data_seconds.get(unit.name, 0.0),
            }
        reads = {r.tensor for t in unit.forward for r in graph.task(t).requirements}
        rows.append(row | {"sharded": sorted(reads & strategy.sharded)})
    return rows


def _choice_rows(result: SearchResult) -> list[dict]:
    """Why auto chose each layer's grid: the rows of `why`."""
    return [
        {
            "layer": c.unit,
            "family": c.family,
            "grid": list(c.grid),
            "seconds": c.seconds,
            "data_seconds": c.data_seconds,
        }
        for c in result.choices
    ]


def resolve_stages(
    graph: TaskGraph,
    name: str,
    nranks: int,
    machine: Machine,
    time_limit: float,
    schedule: str | None,
    micro_batches: int | None,
    note: Callable[[str], None] | None = None,
    param_homes: str | None = None,
    peak: PeakFn | None = None,
    step: StepFn | None = None,
    lower: LowerFn | None = None,
    sums: SumsFn | None = None,
    share: ShareFn | None = None,
    compared: ComparedFn | None = None,
) -> tuple[TaskGraph, Strategy, list[dict] | None, PipelineSearch]:
    """`--stages auto`: the step of the unsplit `graph` in the stages, micro-batches
    (`micro_batches` where given), cuts and schedule (`schedule` where given) of least
    predicted step on `nranks` ranks, each stage
    split as `name` says (`search.stages.choose_pipeline`); that step's strategy and auto's reasons as
    `resolve_strategy` gives them; and the search. `share` works the candidates out on idle
    cores at once (the commands pass `StepModel.share_out`): each is planned and predicted
    alone, in one process, so the second core had stood idle (deep-mlp on 8 ranks: seven
    candidates of 2-3 s each). `compared` gives a candidate's plan's sum and its simulated
    step where that is cheap on any number of ranks (the commands pass `runtime.step.model.
    StepModel.compared_steps`); without it, the candidates are compared by their sums."""
    if name not in BUILTIN and name != "auto":
        raise LegionNNError(
            f"--strategy {name} with --stages auto: a grids file fixes its grids' ranks, and "
            "with them the stages; give --stages S (or name them in the file)"
        )
    if name in BUILTIN:
        families = [name]
    else:
        families = ["data"] if batch_only(graph) else list(BUILTIN)
    resolved: dict[tuple, tuple[TaskGraph, Strategy, list[dict] | None]] = {}

    def priced(candidate: TaskGraph) -> tuple[tuple[float, float | None], Strategy, list | None]:
        """The candidate's predicted steps (sum, simulated or None), strategy and reasons, in
        whichever process."""
        strategy, why = resolve_strategy(
            candidate, name, nranks, machine, time_limit, note, param_homes, peak, step, lower,
            sums,
        )  # fmt: skip
        plan = build_plan(candidate, strategy, nranks)
        if peak is not None and peak(candidate, plan) > machine.memory_bytes:
            return (math.inf, math.inf), strategy, why
        if compared is None:
            return (bulk_seconds(candidate, plan, machine), None), strategy, why
        return compared(candidate, plan), strategy, why

    def predict(shape: PipelineChoice, candidate: TaskGraph) -> tuple[float, float | None]:
        seconds, strategy, why = priced(candidate)
        resolved[shape.key] = (candidate, strategy, why)
        return seconds

    def predict_each(trying) -> list[tuple[float, float | None]]:
        found = share({k: partial(priced, candidate) for k, (_, candidate) in enumerate(trying)})
        for (shape, candidate), (_, strategy, why) in zip(trying, found.values(), strict=True):
            resolved[shape.key] = (candidate, strategy, why)
        return [seconds for seconds, _, _ in found.values()]

    def simulates(candidate: TaskGraph) -> bool:
        return step is not None and not (sums is not None and sums(candidate, nranks))

    search = choose_pipeline(
        graph, nranks, families, machine, schedule, micro_batches, predict, simulates,
        predict_each if share is not None else None,
    )  # fmt: skip
    return *resolved[search.chosen.key], search


def _auto_in_stages(
    graph: TaskGraph,
    nranks: int,
    machine: Machine,
    param_homes: str | None,
    step: StepFn | None,
    lower: LowerFn | None = None,
    sums: SumsFn | None = None,
    share: ShareFn | None = None,
) -> Strategy:
    """`auto` in a pipeline's stages: of the built-in families that split every stage's layers
    over its ranks, and of the mixture giving each layer its family of least seconds in the cost
    model's rows, the one of least predicted step (`_fastest`). The stages are the graph's.

    Where the step compared is the sum (no `step`, or `sums` says so), the plans are needed for
    their rows and sums alone, so `share` (where given) prices the built-ins at once on idle
    cores (vgg19 on 1024 ranks: 0.6-0.9 s a plan); the plan chosen is then built here if it was
    priced elsewhere."""
    homes = param_homes or "replicated"
    families = ["data"] if batch_only(graph) else list(BUILTIN)
    candidates = [with_homes(graph, builtin(graph, f, nranks), homes) for f in families]
    cache = graph_pieces(graph)  # the mixture repeats most of its families' tasks: found once
    by_sum = step is None or (sums is not None and sums(graph, nranks))
    plans: dict[int, Plan] = {}

    def priced(i: int) -> tuple[dict[str, float], float]:
        """Candidate i's rows (seconds per unit) and bulk-synchronous step; its plan kept (in
        the process that priced it)."""
        plans[i] = build_plan(graph, candidates[i], nranks, cache=cache)
        costs = task_costs(graph, plans[i], machine)
        return unit_seconds(costs), step_seconds(costs)

    # the processes begin with the families that move activations, slower to plan; this
    # process takes data parallelism's first (vgg19 on 1024 ranks: 0.55 s against 0.75-1.07 s)
    order = sorted(range(len(candidates)), key=lambda i: families[i] == "data")
    jobs = {i: partial(priced, i) for i in order}
    found = share(jobs) if share is not None and by_sum else {i: job() for i, job in jobs.items()}
    rows = [found[i][0] for i in range(len(candidates))]
    seconds = [found[i][1] for i in range(len(candidates))]

    def cheapest(unit: str) -> Strategy:
        return candidates[min(range(len(rows)), key=lambda i: rows[i].get(unit, 0.0))]

    mixed = {unit: cheapest(unit).unit_grids[unit] for unit in candidates[0].unit_grids}
    if all(mixed != c.unit_grids for c in candidates):
        candidates.append(replace(candidates[0], name="auto", unit_grids=mixed))
        seconds.append(priced(len(candidates) - 1)[1])
    if not by_sum:
        ordered = [plans[i] for i in range(len(candidates))]
        return candidates[_least(graph, ordered, seconds, step, lower)]
    chosen = seconds.index(min(seconds))
    if step is not None:  # the step model keeps the plan it is asked about, for the command
        plan = plans.get(chosen) or build_plan(graph, candidates[chosen], nranks, cache=cache)
        step(graph, plan, seconds[chosen])
    return candidates[chosen]


def _fastest(
    graph: TaskGraph,
    candidates: list[Strategy],
    nranks: int,
    machine: Machine,
    step: StepFn | None,
    lower: LowerFn | None = None,
) -> int:
    """The index of the candidate of least predicted step (`_least`)."""
    plans = [build_plan(graph, s, nranks) for s in candidates]
    return _least(graph, plans, [bulk_seconds(graph, p, machine) for p in plans], step, lower)


def _least(
    graph: TaskGraph,
    plans: list[Plan],
    bulk: list[float],
    step: StepFn | None,
    lower: LowerFn | None = None,
) -> int:
    """The index of the plan of least predicted step: by `step` among those whose
    bulk-synchronous sums `bulk` are near the least (`memory_fit.least_step`, sparing the steps
    of plans `lower` rules out), else by the sum."""
    if step is None:
        return bulk.index(min(bulk))
    bound = None if lower is None else (lambda i: lower(graph, plans[i]))
    return least_step(bulk, lambda i: step(graph, plans[i], bulk[i]), bound)


def _resolve(
    graph: TaskGraph,
    name: str,
    nranks: int,
    machine: Machine,
    time_limit: float,
    note: Callable[[str], None] | None,
) -> tuple[Strategy, list[dict] | None, SearchResult | None]:
    """The strategy `name` stands for, auto's reasons and its search's result."""
    check_plannable(graph)
    if name in ("auto", "model", "spatial") and batch_only(graph):
        what = graph.network or "this graph"
        if name == "auto":
            if note is not None:
                note(
                    f"auto: the tasks of {what} can be cut over the batch only: planning data "
                    "parallelism"
                )
            return builtin(graph, "data", nranks), None, None
        raise LegionNNError(
            f"--strategy {name}: the tasks of {what} can be cut over the batch only (imported "
            "graphs support data parallelism: their functions have batch-parallel access maps, "
            "no channel or spatial ones); use --strategy data"
        )
    if name == "auto":
        result = auto(graph, nranks, machine, time_limit)
        return result.strategy, _choice_rows(result), result
    if name in BUILTIN:
        return builtin(graph, name, nranks), None, None
    check_strategy_name(name)
    return grids_strategy(graph, name, read_grids(name), nranks), None, None


def strategy_chooser(
    name: str,
    machine: Machine,
    time_limit: float,
    param_homes: str | None = None,
    peak: PeakFn | None = None,
    step: StepFn | None = None,
) -> str | Callable[[TaskGraph, int], Strategy]:
    """A built-in's name, or how to choose the strategy `name` stands for with `param_homes`
    once the graph is known (`resolve_strategy`); a bad name, strategy file or `param_homes`
    fails here, before any graph."""
    check_strategy_name(name)
    check_param_homes(param_homes)
    if name in BUILTIN and param_homes in (None, "replicated"):
        return name
    grids = read_grids(name) if name.endswith(".json") else None

    def choose(graph: TaskGraph, nranks: int) -> Strategy:
        if grids is not None:
            strategy = grids_strategy(graph, name, grids, nranks)
            return with_homes(graph, strategy, param_homes or "replicated")
        return resolve_strategy(
            graph, name, nranks, machine, time_limit, None, param_homes, peak, step
        )[0]

    return choose
