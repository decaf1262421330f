"""Task-graph JSON, format `legion-nn/taskgraph-v1` (docs/formats.md), both ways.

Beyond the design's keys, each tensor may carry `init` and `bytes`, and each task its `space`,
`layer` and `attrs`, so a graph read back is the graph written. Reading checks the structure and
reports the first problem as one line naming the file and the entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import legion_nn.op_records  # noqa: F401  (a loaded graph's ops have their records for `verify`)
from legion_nn.errors import LegionNNError, VerifyError, read_input
from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.verify import verify

FORMAT = "legion-nn/taskgraph-v1"


def _rect(rect: Rect | None) -> dict | None:
    return None if rect is None else rect.to_json()


def graph_to_json(graph: TaskGraph) -> dict[str, Any]:
    tensors = []
    for t in graph.tensors.values():
        entry: dict[str, Any] = {
            "name": t.name,
            "dims": list(t.dims),
            "dtype": t.dtype,
            "kind": t.kind,
        }
        if t.init:
            entry["init"] = t.init
        if t.nbytes_override is not None:
            entry["bytes"] = t.nbytes_override
        tensors.append(entry)
    tasks = []
    for task in graph.tasks:
        tasks.append(
            {
                "name": task.name,
                "op": task.op,
                "phase": task.phase,
                "result_dim": list(task.result_dim),
                "dist": {role: rect.to_json() for role, rect in task.dist.items()},
                "space": task.space.to_json(),
                "layer": task.layer,
                "attrs": task.attrs,
                "requirements": [
                    {
                        "tensor": r.tensor,
                        "role": r.role,
                        "privilege": str(r.privilege),
                        "read_rect": _rect(r.read_rect),
                        "write_rect": _rect(r.write_rect),
                    }
                    for r in task.requirements
                ],
            }
        )
    return {
        "format": FORMAT,
        "network": graph.network,
        "batch": graph.batch,
        "tensors": tensors,
        "tasks": tasks,
    }


def dumps(graph: TaskGraph) -> str:
    return json.dumps(graph_to_json(graph), indent=1) + "\n"


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> LegionNNError:
        return LegionNNError(f"{self.source}: {where}: {message}")

    def get(self, obj: Any, key: str, where: str, kind: type | tuple) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(where, f"missing key {key!r}")
        value = obj[key]
        if not isinstance(value, kind):
            raise self.fail(where, f"{key!r} has the wrong type ({type(value).__name__})")
        return value

    def rect(self, value: Any, where: str) -> Rect | None:
        if value is None:
            return None
        try:
            lo, hi = value["lo"], value["hi"]
            if not all(isinstance(v, int) for v in lo + hi) or len(lo) != len(hi):
                raise TypeError
            return Rect(tuple(lo), tuple(hi))
        except (TypeError, KeyError):
            raise self.fail(where, f"not a rect {{'lo': [...], 'hi': [...]}}: {value!r}") from None


def graph_from_json(data: Any, source: str = "<graph>") -> TaskGraph:
    r = _Reader(source)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LegionNNError(f"{source}: not a legion-nn task graph (format must be {FORMAT!r})")
    tensors = []
    for i, entry in enumerate(r.get(data, "tensors", "top level", list)):
        where = f"tensors[{i}]"
        tensors.append(
            Tensor(
                r.get(entry, "name", where, str),
                tuple(r.get(entry, "dims", where, list)),
                r.get(entry, "dtype", where, str),
                r.get(entry, "kind", where, str),
                nbytes_override=entry.get("bytes"),
                init=entry.get("init", ""),
            )
        )
    tasks = []
    for i, entry in enumerate(r.get(data, "tasks", "top level", list)):
        where = f"tasks[{i}]"
        name = r.get(entry, "name", where, str)
        where = f"tasks[{i}] ({name})"
        requirements = []
        for j, req in enumerate(r.get(entry, "requirements", where, list)):
            rwhere = f"{where} requirements[{j}]"
            privilege = r.get(req, "privilege", rwhere, str)
            if privilege not in {p.value for p in Privilege}:
                raise r.fail(rwhere, f"unknown privilege {privilege!r}")
            requirements.append(
                Requirement(
                    r.get(req, "tensor", rwhere, str),
                    r.get(req, "role", rwhere, str),
                    Privilege(privilege),
                    r.rect(req.get("read_rect"), rwhere),
                    r.rect(req.get("write_rect"), rwhere),
                )
            )
        dist = {
            role: r.rect(rect, f"{where} dist.{role}")
            for role, rect in r.get(entry, "dist", where, dict).items()
        }
        result_dim = tuple(r.get(entry, "result_dim", where, list))
        space = (
            r.rect(entry.get("space"), f"{where} space")
            or dist.get("result")
            or Rect.from_dims(result_dim)
        )
        tasks.append(
            Task(
                name=name,
                op=r.get(entry, "op", where, str),
                phase=r.get(entry, "phase", where, str),
                result_dim=result_dim,
                dist=dist,
                requirements=tuple(requirements),
                space=space,
                layer=entry.get("layer", ""),
                attrs=entry.get("attrs", {}),
            )
        )
    return TaskGraph(tensors, tasks, network=data.get("network", ""), batch=data.get("batch", 0))


def load_graph(path: str | Path) -> TaskGraph:
    path = Path(path)
    text = read_input(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    graph = graph_from_json(data, str(path))
    try:
        verify(graph)
    except VerifyError as exc:
        raise LegionNNError(f"{path}: the task graph does not verify: {exc}") from None
    return graph
