"""A `--strategy` argument as the commands take it: `data`, `model`, `spatial`, `auto` or a file.

A strategy file is JSON, `{"grids": {unit: [parts per dim], ...}}`, one grid per unit cutting it
into exactly R pieces (`strategy.from_grids`). `auto` searches under the cost model of a machine
(`search.auto`) and also returns why it chose each grid. `legion-nn partition` and
`legion-nn render --ranks` resolve the argument here, and `legion-nn train` chooses with it
(`strategy_chooser`, which checks the argument before MPI starts), so all mean the same plan by it.

A graph whose tasks can be cut over the batch only, as an imported graph's are, has one plan to
offer: `data`, which `auto` then is (with a note saying so), while `model` and `spatial` are
refused with one line rather than quietly planned as `data`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ops import has_access_map
from partitioner.machine import Machine
from partitioner.search import auto
from partitioner.strategy import BUILTIN, STRATEGY_NAMES, Strategy, builtin, find_units, from_grids


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
) -> tuple[Strategy, list[dict] | None]:
    """The strategy `name` stands for on `nranks` ranks, and auto's reasons (None otherwise);
    `note` hears why `auto` settled for `data` on a batch-only graph."""
    check_plannable(graph)
    if name in ("auto", "model", "spatial") and batch_only(graph):
        what = graph.network or "this graph"
        if name == "auto":
            if note is not None:
                note(
                    f"auto: the tasks of {what} can be cut over the batch only: planning data "
                    "parallelism"
                )
            return builtin(graph, "data", nranks), None
        raise LegionNNError(
            f"--strategy {name}: the tasks of {what} can be cut over the batch only (imported "
            "graphs support data parallelism: their functions have batch-parallel access maps, "
            "no channel or spatial ones); use --strategy data"
        )
    if name == "auto":
        result = auto(graph, nranks, machine, time_limit)
        why = [
            {
                "layer": c.unit,
                "family": c.family,
                "grid": list(c.grid),
                "seconds": c.seconds,
                "data_seconds": c.data_seconds,
            }
            for c in result.choices
        ]
        return result.strategy, why
    if name in BUILTIN:
        return builtin(graph, name, nranks), None
    check_strategy_name(name)
    return grids_strategy(graph, name, read_grids(name), nranks), None


def strategy_chooser(
    name: str, machine: Machine, time_limit: float
) -> str | Callable[[TaskGraph, int], Strategy]:
    """A built-in's name, or how to choose the strategy `name` stands for once the graph is
    known (`resolve_strategy`); a bad name or strategy file fails here, before any graph."""
    check_strategy_name(name)
    if name in BUILTIN:
        return name
    grids = read_grids(name) if name != "auto" else None

    def choose(graph: TaskGraph, nranks: int) -> Strategy:
        if grids is not None:
            return grids_strategy(graph, name, grids, nranks)
        return resolve_strategy(graph, name, nranks, machine, time_limit)[0]

    return choose


def check_strategy_name(name: str) -> None:
    """A built-in, `auto`, or a JSON file of grids; anything else is one line."""
    if name not in STRATEGY_NAMES and not name.endswith(".json"):
        raise LegionNNError(
            f"--strategy: unknown strategy {name!r}; choose one of "
            f"{', '.join(STRATEGY_NAMES)}, or a JSON file of grids"
        )


def read_grids(path: str) -> dict:
    """The `{unit: [parts, ...]}` of a strategy file `{"grids": ...}`."""
    try:
        with open(path) as handle:
            spec = json.load(handle)
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("grids"), dict):
        raise LegionNNError(f'{path}: a strategy file is {{"grids": {{unit: [parts, ...]}}}}')
    return spec["grids"]


def grids_strategy(graph: TaskGraph, path: str, grids: dict, nranks: int) -> Strategy:
    try:
        return from_grids(graph, grids, nranks)
    except LegionNNError as exc:
        raise LegionNNError(f"{path}: {exc}") from None
