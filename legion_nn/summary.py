"""Per-tensor summaries of a graph's requirements: the `read_rect` and `write_rect` of a tensor.

The seed draws each tensor with one read rect and one write rect. legion-nn derives them from the
requirements: the bounding union of every rect read, and of every rect written within the step.
An update task's write of its parameter is the value for the *next* step (it is drawn on the
update task's `params` edge, not on the tensor), which is why a parameter shows `write_rect=None`
as in the seed. A read of an empty rect, as softmax's backward makes of the loss gradient, shows
as an empty rect.
"""

from __future__ import annotations

from dataclasses import dataclass

from legion_nn.graph import TaskGraph
from legion_nn.rect import Rect


@dataclass(frozen=True)
class TensorSummary:
    read_rect: Rect | None
    write_rect: Rect | None


def _merge(current: Rect | None, rect: Rect) -> Rect:
    return rect if current is None else current.union_bounds(rect)


def tensor_summaries(graph: TaskGraph) -> dict[str, TensorSummary]:
    reads: dict[str, Rect | None] = {name: None for name in graph.tensors}
    writes: dict[str, Rect | None] = {name: None for name in graph.tensors}
    for task in graph.tasks:
        for req in task.requirements:
            if req.read_rect is not None:
                reads[req.tensor] = _merge(reads[req.tensor], req.read_rect)
            if req.write_rect is not None and task.phase != "update":
                writes[req.tensor] = _merge(writes[req.tensor], req.write_rect)
    return {name: TensorSummary(reads[name], writes[name]) for name in graph.tensors}
