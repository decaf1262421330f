"""A strategy file, as `--strategy F.json` names it: JSON, `{"grids": {unit: [parts per dim],
...}}`, one grid per unit cutting it into exactly R pieces (`strategy.from_grids`), and optionally
`"stages"`, the layers of each pipeline stage. Every fault in it is one line naming the file.
"""

from __future__ import annotations

import json

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from partitioner.strategy import STRATEGY_NAMES, Strategy, from_grids


def check_strategy_name(name: str) -> None:
    """A built-in, `auto`, or a JSON file of grids; anything else is one line."""
    if name not in STRATEGY_NAMES and not name.endswith(".json"):
        raise LegionNNError(
            f"--strategy: unknown strategy {name!r}; choose one of "
            f"{', '.join(STRATEGY_NAMES)}, or a JSON file of grids"
        )


def read_grids(path: str) -> dict:
    """The `{unit: [parts, ...]}` of a strategy file `{"grids": ...}`."""
    return _strategy_file(path)["grids"]


def read_stages(path: str) -> list[list[str]] | None:
    """The stages a strategy file names, each its layers in order (`"stages": [[layer, ...],
    ...]`, or each stage `{"layers": [...]}` as `partition --json` reports them); None where it
    names none. Its grids then cut each layer over its stage's ranks."""
    stages = _strategy_file(path).get("stages")
    if stages is None:
        return None
    out = []
    for stage in stages if isinstance(stages, list) else [None]:
        layers = stage.get("layers") if isinstance(stage, dict) else stage
        if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
            raise LegionNNError(
                f'{path}: "stages" is a list of stages, each a list of layers (or {{"layers": '
                "[...]}})"
            )
        out.append(layers)
    return out


def _strategy_file(path: str) -> dict:
    try:
        with open(path) as handle:
            spec = json.load(handle)
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("grids"), dict):
        raise LegionNNError(f'{path}: a strategy file is {{"grids": {{unit: [parts, ...]}}}}')
    return spec


def grids_strategy(graph: TaskGraph, path: str, grids: dict, nranks: int) -> Strategy:
    try:
        return from_grids(graph, grids, nranks)
    except LegionNNError as exc:
        raise LegionNNError(f"{path}: {exc}") from None
