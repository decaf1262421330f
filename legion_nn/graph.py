"""`TaskGraph`: tasks in program order plus the dependences their region requirements imply.

Semantics are sequential, as in Legion: the graph means "run the tasks in list order", and a
dependence is any pair of accesses, earlier and later, to overlapping rects of one tensor with
conflicting privileges (RAW, WAR, WAW; read/read and same-operator reductions commute). Any
schedule that respects the dependences computes what the sequential order computes; this is what
lets the runtime reorder, overlap and distribute the work.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import conflicts, dependence_kind


@dataclass(frozen=True)
class Dependence:
    src: str
    dst: str
    tensor: str
    kind: str


class TaskGraph:
    """Tensors by name and tasks in program order; dependences are derived on first use."""

    def __init__(
        self,
        tensors: Iterable[Tensor],
        tasks: Iterable[Task],
        network: str = "",
        batch: int = 0,
        extra_dependences: Iterable[Dependence] = (),
    ) -> None:
        self.tensors: dict[str, Tensor] = {}
        for tensor in tensors:
            self.tensors[tensor.name] = tensor
        self.tasks: list[Task] = list(tasks)
        self.network = network
        self.batch = batch
        self.extra_dependences = tuple(extra_dependences)
        self._by_name = {task.name: task for task in self.tasks}
        self._dependences: list[Dependence] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def task(self, name: str) -> Task:
        return self._by_name[name]

    def index(self, name: str) -> int:
        return self.tasks.index(self._by_name[name])

    def tasks_in_phase(self, phase: str) -> list[Task]:
        return [task for task in self.tasks if task.phase == phase]

    @property
    def dependences(self) -> list[Dependence]:
        if self._dependences is None:
            self._dependences = self._derive_dependences() + list(self.extra_dependences)
        return self._dependences

    def _derive_dependences(self) -> list[Dependence]:
        # Accesses so far, per tensor: (task name, requirement). Only the latest writer of each
        # point matters for RAW, but reads since then all matter for WAR, so keep them all; the
        # per-tensor lists stay short in lowered graphs.
        history: dict[str, list[tuple[str, Requirement]]] = defaultdict(list)
        found: dict[tuple[str, str, str], str] = {}
        for task in self.tasks:
            for req in task.requirements:
                if req.rect is None:
                    continue
                for earlier_task, earlier in history[req.tensor]:
                    if earlier_task == task.name:
                        continue
                    if not conflicts(earlier.privilege, req.privilege):
                        continue
                    if not earlier.rect.overlaps(req.rect):
                        continue
                    key = (earlier_task, task.name, req.tensor)
                    found.setdefault(key, dependence_kind(earlier.privilege, req.privilege))
            for req in task.requirements:
                if req.rect is not None:
                    history[req.tensor].append((task.name, req))
        return [Dependence(src, dst, tensor, kind) for (src, dst, tensor), kind in found.items()]

    def predecessors(self) -> dict[str, set[str]]:
        preds: dict[str, set[str]] = {task.name: set() for task in self.tasks}
        for dep in self.dependences:
            preds[dep.dst].add(dep.src)
        return preds

    def producers(self, tensor: str) -> list[Task]:
        return [
            t
            for t in self.tasks
            if any(r.tensor == tensor and r.write_rect is not None for r in t.requirements)
        ]

    def consumers(self, tensor: str) -> list[Task]:
        return [
            t
            for t in self.tasks
            if any(r.tensor == tensor and r.read_rect is not None for r in t.requirements)
        ]


def inference_tasks(graph: TaskGraph) -> list[Task]:
    """The forward pass alone: forward tasks and the zeroing of the statistics they reduce into."""
    return [
        task
        for task in graph.tasks
        if task.phase == "forward"
        or (task.phase == "set_zero" and graph.tensors[task.requirements[0].tensor].kind != "grad")
    ]
