"""What a command's NETWORK argument can name, and the task graph it stands for.

- a task-graph JSON (`legion-nn/taskgraph-v1`, recognised by its `format` key): read as is;
- a Chainer graph dump (any other existing file that is not `.json`/`.toml`/`.onnx`): imported;
- a built-in network's name, an ONNX model or a JSON/TOML spec file: lowered at the batch asked
  for (an ONNX model's batch dim, fixed or dynamic, is that batch).
"""

from __future__ import annotations

import json
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph

SPEC_SUFFIXES = (".json", ".toml")


def is_graph_json(path: Path) -> bool:
    """A task-graph JSON rather than a network spec: a JSON object with a `format` key."""
    if path.suffix.lower() != ".json" or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # unreadable either way; the spec loader reports it in one line
    return isinstance(data, dict) and "format" in data


def is_dump(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() not in (*SPEC_SUFFIXES, ".onnx")


def load_source_graph(
    source: str,
    batch: int | None,
    default_batch: int,
    dtype: str = "float32",
    optimizer: str = "adam",
) -> TaskGraph:
    """The graph `source` names; `batch` overrides a dump's batch and sets a network's, which
    lowers to a step of `optimizer` over `dtype` (an imported graph or a dump has its own)."""
    if batch is not None and batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {batch}")
    path = Path(source)
    if is_graph_json(path):
        from legion_nn.graphjson import load_graph

        if batch is not None:
            raise LegionNNError(f"--batch applies to networks and dumps; {path} is a task graph")
        return load_graph(path)
    if is_dump(path):
        from legion_nn.importers.chainer_graph import import_dump

        return import_dump(path, batch=batch, network=path.stem)
    from legion_nn.networks import load_network

    return load_network(source).lower(
        batch=default_batch if batch is None else batch, dtype=dtype, optimizer=optimizer
    )
