"""`verify(graph)`: every invariant of a task graph, checked in one place with exact messages.

Runs after lowering, after import and after partitioning. The checks, in order:

1. names: task names unique; every requirement names a declared tensor; phases and kinds known;
2. rects: each requirement has the rects its privilege implies (read: read_rect; write and reduce:
   write_rect; read_write: both), of the tensor's rank and inside its dims; each task's
   `result_dim` is the shape of its `dist["result"]` (a backward task keeps its forward task's);
3. lowering: for ops with an access map, the requirements are exactly what the map gives for the
   task's space, so producers and consumers agree on every tensor's dims and layout, and the
   partitioner's view of a task is the task;
4. no cycle among the dependences;
5. dataflow: every rect read (or reduced into) is written earlier in program order, unless the
   tensor is resident (data, params, state);
6. coverage: every element of a non-resident tensor is written by some task, so a producer and the
   dims its consumers were built for cannot disagree unnoticed.

`verify` raises `VerifyError` on the first failure; `problems` lists them all.
"""

from __future__ import annotations

from collections import defaultdict

from legion_nn.errors import VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.ir import KINDS, PHASES, Requirement
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.registry import has_access_map, piece_requirements


def verify(graph: TaskGraph) -> None:
    found = problems(graph, first_only=True)
    if found:
        raise VerifyError(found[0])


def problems(graph: TaskGraph, first_only: bool = False) -> list[str]:
    out: list[str] = []
    checks = (
        _check_names,
        _check_rects,
        _check_lowering,
        _check_acyclic,
        _check_dataflow,
        _check_coverage,
    )
    for check in checks:
        out.extend(check(graph))
        if out and first_only:
            break
    return out


def _check_names(graph: TaskGraph) -> list[str]:
    out = []
    seen: set[str] = set()
    for tensor in graph.tensors.values():
        if tensor.kind not in KINDS:
            out.append(
                f"tensor {tensor.name}: unknown kind {tensor.kind!r} (one of {', '.join(KINDS)})"
            )
        if any(d < 0 for d in tensor.dims):
            out.append(f"tensor {tensor.name}: negative dim in {list(tensor.dims)}")
    for task in graph.tasks:
        if task.name in seen:
            out.append(f"task {task.name}: name used by two tasks")
        seen.add(task.name)
        if task.phase not in PHASES:
            out.append(
                f"task {task.name}: unknown phase {task.phase!r} (one of {', '.join(PHASES)})"
            )
        for req in task.requirements:
            if req.tensor not in graph.tensors:
                out.append(
                    f"task {task.name}: role {req.role} names undeclared tensor {req.tensor}"
                )
    return out


def _expected_rects(req: Requirement) -> str | None:
    wants_read = req.privilege.reads
    wants_write = req.privilege.writes
    if wants_read != (req.read_rect is not None) or wants_write != (req.write_rect is not None):
        shape = {True: "a", False: "no"}
        return (
            f"{req.privilege} privilege needs {shape[wants_read]} read_rect and "
            f"{shape[wants_write]} write_rect"
        )
    return None


def _check_rects(graph: TaskGraph) -> list[str]:
    out = []
    for task in graph.tasks:
        result = task.dist.get("result")
        if result is None:
            out.append(f"task {task.name}: no dist rect for 'result'")
        elif task.phase != "backward" and result.shape != tuple(task.result_dim):
            out.append(
                f"task {task.name}: result_dim {list(task.result_dim)} is not the shape of "
                f"dist_result {result!r}"
            )
        for req in task.requirements:
            tensor = graph.tensors.get(req.tensor)
            if tensor is None:
                continue
            where = f"task {task.name}: {req.role} requirement on {req.tensor}"
            problem = _expected_rects(req)
            if problem:
                out.append(f"{where}: {problem}")
                continue
            for label, rect in (("read_rect", req.read_rect), ("write_rect", req.write_rect)):
                if rect is None:
                    continue
                if rect.ndim != len(tensor.dims):
                    out.append(
                        f"{where}: {label} {rect!r} has {rect.ndim} dims but the tensor has "
                        f"{len(tensor.dims)} (dims {list(tensor.dims)})"
                    )
                elif not tensor.rect.contains(rect):
                    out.append(f"{where}: {label} {rect!r} is outside its dims {list(tensor.dims)}")
    return out


def _check_lowering(graph: TaskGraph) -> list[str]:
    out = []
    for task in graph.tasks:
        if not has_access_map(task.op, task.phase):
            continue
        if any(req.tensor not in graph.tensors for req in task.requirements):
            continue
        try:
            expected = piece_requirements(task, graph.tensors, task.space)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            out.append(
                f"task {task.name}: the {task.op} access map cannot be applied to its space "
                f"{task.space!r} and tensors: {exc}"
            )
            continue
        for got, want in zip(task.requirements, expected):
            if got != want:
                rect = "read_rect" if got.read_rect != want.read_rect else "write_rect"
                out.append(
                    f"task {task.name}: {got.role} requirement on {got.tensor} has {rect} "
                    f"{getattr(got, rect)!r} but the {task.op} access map of its space gives "
                    f"{getattr(want, rect)!r} (tensor dims {list(graph.tensors[got.tensor].dims)})"
                )
    return out


def _check_acyclic(graph: TaskGraph) -> list[str]:
    successors: dict[str, list[str]] = defaultdict(list)
    for dep in graph.dependences:
        successors[dep.src].append(dep.dst)
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in (task.name for task in graph.tasks):
        if root in state:
            continue
        path = [root]
        stack = [iter(successors[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                return [f"dependence cycle: {' -> '.join(cycle)}"]
            if nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(successors[nxt]))
    return []


def _check_dataflow(graph: TaskGraph) -> list[str]:
    out = []
    written: dict[str, list[Rect]] = defaultdict(list)
    for task in graph.tasks:
        for req in task.requirements:
            tensor = graph.tensors.get(req.tensor)
            if tensor is None or tensor.resident:
                continue
            needs = req.read_rect if req.read_rect is not None else None
            if req.privilege is Privilege.REDUCE:
                needs = req.write_rect
            if needs is None or needs.is_empty():
                continue
            missing = needs.minus(written[req.tensor])
            if missing:
                verb = "reduces into" if req.privilege is Privilege.REDUCE else "reads"
                out.append(
                    f"task {task.name} {verb} {req.tensor} {needs!r} before any earlier task "
                    f"writes {missing[0]!r}"
                )
        for req in task.requirements:
            if req.write_rect is not None and not req.write_rect.is_empty():
                written[req.tensor].append(req.write_rect)
    return out


def _check_coverage(graph: TaskGraph) -> list[str]:
    written: dict[str, list[Rect]] = defaultdict(list)
    for task in graph.tasks:
        for req in task.requirements:
            if req.write_rect is not None and not req.write_rect.is_empty():
                written[req.tensor].append(req.write_rect)
    out = []
    for tensor in graph.tensors.values():
        if tensor.resident:
            continue
        missing = tensor.rect.minus(written[tensor.name])
        if missing:
            out.append(
                f"tensor {tensor.name} (dims {list(tensor.dims)}): no task writes {missing[0]!r}"
            )
    return out
