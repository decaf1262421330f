"""The text form of a task graph, in the seed's vocabulary.

Tasks appear in program order; each tensor is shown once, where the program first touches it.
Edges are written as in the seed: `->role` for a tensor read by a task, `role->` for a tensor a task
writes::

    task L0.filter
      result_dim=[256 64 33 33]
      dist_input=Rect(array([0, 0, 0, 0], dtype=int32), array([256, 1, 41, 41], dtype=int32))
      ...
      data.raw_output ->input
      output-> L0.filter.output
"""

from __future__ import annotations

from legion_nn.graph import TaskGraph
from legion_nn.summary import tensor_summaries


def dims_text(dims) -> str:
    return "[" + " ".join(str(d) for d in dims) + "]"


def graph_text(graph: TaskGraph) -> str:
    summaries = tensor_summaries(graph)
    shown: set[str] = set()
    header = (
        f"# task graph of {graph.network} at batch {graph.batch}: "
        f"{len(graph.tasks)} tasks, {len(graph.tensors)} tensors"
    )
    lines = [header]

    def show_tensor(name: str) -> None:
        if name in shown:
            return
        shown.add(name)
        tensor = graph.tensors[name]
        summary = summaries[name]
        lines.extend(
            [
                "",
                f"tensor {name}",
                f"  kind={tensor.kind} dtype={tensor.dtype}",
                f"  dim={dims_text(tensor.dims)}",
                f"  read_rect={summary.read_rect!r}",
                f"  write_rect={summary.write_rect!r}",
            ]
        )

    for task in graph.tasks:
        for req in task.requirements:
            if req.read_rect is not None:
                show_tensor(req.tensor)
        lines.extend(
            [
                "",
                f"task {task.name}",
                f"  op={task.op} phase={task.phase}",
                f"  result_dim={dims_text(task.result_dim)}",
            ]
        )
        for role, rect in sorted(task.dist.items(), key=lambda item: item[0] == "result"):
            lines.append(f"  dist_{role}={rect!r}")
        for req in task.requirements:
            if req.read_rect is not None:
                lines.append(f"  {req.tensor} ->{req.role}")
        for req in task.requirements:
            if req.write_rect is not None:
                lines.append(f"  {req.role}-> {req.tensor}")
        for req in task.requirements:
            if req.write_rect is not None:
                show_tensor(req.tensor)
    return "\n".join(lines) + "\n"
