"""A `--strategy` argument as the commands take it: `data`, `model`, `spatial`, `auto` or a file.

A strategy file is JSON, `{"grids": {unit: [parts per dim], ...}}`, one grid per unit cutting it
into exactly R pieces (`strategy.from_grids`). `auto` searches under the cost model of a machine
(`search.auto`) and also returns why it chose each grid. `legion-nn partition` and
`legion-nn render --ranks` resolve the argument here, so both mean the same plan by it.
"""

from __future__ import annotations

import json

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.search import auto
from partitioner.strategy import BUILTIN, Strategy, builtin, from_grids


def resolve_strategy(
    graph: TaskGraph, name: str, nranks: int, machine: Machine, time_limit: float
) -> tuple[Strategy, list[dict] | None]:
    """The strategy `name` stands for on `nranks` ranks, and auto's reasons (None otherwise)."""
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
    if name in BUILTIN or not name.endswith(".json"):
        return builtin(graph, name, nranks), None
    try:
        with open(name) as handle:
            spec = json.load(handle)
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{name}: not JSON ({exc.msg})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("grids"), dict):
        raise LegionNNError(f'{name}: a strategy file is {{"grids": {{unit: [parts, ...]}}}}')
    return from_grids(graph, spec["grids"], nranks), None
