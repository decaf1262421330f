"""Peak memory of one training step, from a schedule of functions and the buffers they touch.

The analysis is generic: a `Schedule` is the functions of one step in execution order, each naming
the buffers it reads and writes, and the buffers with their byte sizes and lifetimes. Two feeders
build one, `schedule_from_dump` from a Chainer dump and `schedule_from_graph` from a `TaskGraph`
(lowered or imported), under one rule, so their results compare:

- the schedule is the forward functions by ascending rank, then the backward functions by
  descending rank;
- parameters and step inputs (variables no forward function produces) are live all step;
- any other buffer (a forward variable or a gradient) is allocated at the first function that
  touches it and freed after the last. A forward variable v's data is read by a forward function
  taking v as input and by a backward record listing v as `input` or `output`; a backward record
  listing v as `gradient` reads v's gradient only. So a function's output lives until its last
  reader, not until its own backward, which (a convolution's, say) may need only its gradient;
  the issue's first wording, "any role", kept it until then, which no framework does. A gradient is
  allocated by the first backward function that outputs it, or reads it where nothing produced it
  yet (the loss gradient, just before its first reader). Where the rules are open: a buffer that
  nothing reads is freed after its last writer (a gradient accumulated by two functions lives
  until the second, a loss read only for its gradient after its producer);
- parameter gradients live from their first writer to the end of the step;
- at each function, live bytes = bytes live before it + its new allocations, i.e. everything whose
  lifetime includes it; the peak is the maximum over functions, the first function reaching it.

Data parallelism over R ranks scales every non-parameter buffer that carries the batch B by
ceil(B/R)/B. In a dump a buffer carries the batch when its byte size is a multiple of B and more
than one 4-byte element (so the loss, a batch-free scalar, is never scaled even where B divides 4).
Parameters and their gradients are never scaled.

A task graph maps onto the same rules: its forward and backward tasks in program order are the
schedule (lowering and the importer emit them in the order above; set_zero and update tasks are
not part of it); a requirement with a non-empty read rect reads its tensor, one with a non-empty
write rect writes it, so `output.delta` reads `<t>.grad` and not `t`, as a dump's `gradient` role
does. Resident kinds (data, param, state) are live all step, so optimizer state counts; the
gradient of a param is `<param>.grad`. A tensor carries the batch when its first dim is the
graph's batch, unless it is a param, state, a stat or a param's gradient. A loss gradient read
with an empty rect is never materialised, so a graph does not count the 4 bytes a dump counts for
it; otherwise a dump and the graph imported from it have the same buffers and lifetimes. A lowered
network and a dump of it differ where their functions touch different buffers: the VGG19 dump's
MaxPooling2D backward reads its output, lowered `maxpool.grad` does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.importers.chainer import BACKWARD_ROLES, GRADIENT_ROLE, Dump
from legion_nn.importers.chainer_graph import is_batch_carrying, tensor_name
from legion_nn.rect import Rect

#: lifetimes: the whole step; from the first touch to the end; from the first touch to the last
STEP, TO_END, USED = "step", "to_end", "used"
SCHEDULE_PHASES = ("forward", "backward")
GRAD_SUFFIX = ".grad"
#: the backward roles that read a variable's data; `gradient` reads its gradient only
DATA_ROLES = tuple(r for r in BACKWARD_ROLES if r != GRADIENT_ROLE)


@dataclass(frozen=True)
class Step:
    """One function of the schedule and the buffers it reads and writes."""

    name: str
    phase: str
    reads: frozenset[str]
    writes: frozenset[str]


@dataclass(frozen=True)
class BufferInfo:
    nbytes: int
    lifetime: str  # STEP, TO_END or USED
    scalable: bool  # carries the batch: scaled under data parallelism
    param: bool = False


@dataclass(frozen=True)
class Buffer:
    name: str
    nbytes: int
    first: int  # the function that allocates it
    last: int  # the function after which it is freed
    scalable: bool
    param: bool

    def bytes_per_rank(self, batch: int, ranks: int) -> int:
        if not self.scalable:
            return self.nbytes
        return self.nbytes // batch * math.ceil(batch / ranks)


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    buffers: tuple[Buffer, ...]
    batch: int
    source: str = ""

    @classmethod
    def build(
        cls, steps: Iterable[Step], infos: Mapping[str, BufferInfo], batch: int, source: str = ""
    ) -> Schedule:
        """Lifetimes from the steps' reads and writes (see the module docstring)."""
        steps = tuple(steps)
        touches: dict[str, list[int]] = {}
        for index, step in enumerate(steps):
            for name in step.reads | step.writes:
                touches.setdefault(name, []).append(index)
        end = len(steps) - 1
        buffers = []
        for name, info in infos.items():
            used = touches.get(name)
            if info.lifetime == STEP:
                first, last = 0, end
            elif not used:
                continue
            else:
                first, last = used[0], end if info.lifetime == TO_END else used[-1]
            buffers.append(Buffer(name, info.nbytes, first, last, info.scalable, info.param))
        return cls(steps, tuple(buffers), batch, source)

    def count(self, phase: str) -> int:
        return sum(step.phase == phase for step in self.steps)

    @property
    def param_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.param)

    def live_bytes(self, ranks: int = 1) -> list[int]:
        """Bytes live at each function on one of `ranks` data-parallel ranks."""
        if ranks < 1:
            raise LegionNNError(f"--ranks must be at least 1, got {ranks}")
        delta = [0] * (len(self.steps) + 1)
        for b in self.buffers:
            size = b.bytes_per_rank(self.batch, ranks)
            delta[b.first] += size
            delta[b.last + 1] -= size
        live, total = [], 0
        for change in delta[:-1]:
            total += change
            live.append(total)
        return live

    def analyze(self, ranks: int = 1) -> MemoryReport:
        if not self.steps:
            raise LegionNNError(f"{self.source or 'the graph'}: no forward or backward functions")
        live = self.live_bytes(ranks)
        peak = max(range(len(live)), key=live.__getitem__)
        return MemoryReport(self, ranks, tuple(live), peak)


@dataclass(frozen=True)
class MemoryReport:
    schedule: Schedule
    ranks: int
    live: tuple[int, ...]
    peak_index: int

    @property
    def peak_bytes(self) -> int:
        return self.live[self.peak_index]

    @property
    def peak_step(self) -> Step:
        return self.schedule.steps[self.peak_index]

    def to_json(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_step.name,
            "param_bytes": s.param_bytes,
            "forward_functions": s.count("forward"),
            "backward_functions": s.count("backward"),
            "peak_phase": self.peak_step.phase,
            "peak_index": self.peak_index,
            "ranks": self.ranks,
            "batch": s.batch,
            "source": s.source,
            "schedule": [
                {"function": step.name, "phase": step.phase, "live_bytes": live}
                for step, live in zip(s.steps, self.live)
            ],
        }


def schedule_from_dump(dump: Dump, batch: int | None = None) -> Schedule:
    """The schedule of a Chainer dump; `batch` overrides the label-derived batch."""
    batch = dump.batch(batch)
    produced = dump.produced()
    infos: dict[str, BufferInfo] = {}
    for var in dump.variables.values():
        name, param = tensor_name(dump, var.id), var.is_param
        scalable = is_batch_carrying(var.nbytes, batch, param)
        resident = param or var.id not in produced
        infos[name] = BufferInfo(var.nbytes, STEP if resident else USED, scalable, param)
        infos[name + GRAD_SUFFIX] = BufferInfo(var.nbytes, TO_END if param else USED, scalable)
    steps = []
    for fn in dump.schedule():
        if fn.direction == "forward":
            reads = {tensor_name(dump, v) for v in fn.ids()}
            writes = {tensor_name(dump, v) for v in fn.outputs}
        else:
            reads = {tensor_name(dump, v) for v in fn.ids(*DATA_ROLES)}
            reads |= {tensor_name(dump, v) + GRAD_SUFFIX for v in fn.ids(GRADIENT_ROLE)}
            writes = {tensor_name(dump, v) + GRAD_SUFFIX for v in fn.outputs}
        steps.append(Step(fn.name, fn.direction, frozenset(reads), frozenset(writes)))
    return Schedule.build(steps, infos, batch, dump.source)


def _touches(rect: Rect | None) -> bool:
    return rect is not None and not rect.is_empty()


def schedule_from_graph(graph: TaskGraph) -> Schedule:
    """The schedule of a task graph's forward and backward tasks (read rects read, write rects write)."""
    batch = graph.batch
    if batch < 1:
        raise LegionNNError(f"graph {graph.network or '?'} has no batch")
    infos: dict[str, BufferInfo] = {}
    for t in graph.tensors.values():
        base = graph.tensors.get(t.name.removesuffix(GRAD_SUFFIX)) if t.kind == "grad" else None
        param_grad = base is not None and base.kind == "param"
        scalable = (
            t.kind not in ("param", "state", "stat")
            and not param_grad
            and len(t.dims) > 0
            and t.dims[0] == batch
            and t.nbytes % batch == 0
        )
        lifetime = STEP if t.resident else TO_END if param_grad else USED
        infos[t.name] = BufferInfo(t.nbytes, lifetime, scalable, t.kind == "param")
    steps = [
        Step(
            task.name,
            task.phase,
            frozenset(r.tensor for r in task.requirements if _touches(r.read_rect)),
            frozenset(r.tensor for r in task.requirements if _touches(r.write_rect)),
        )
        for task in graph.tasks
        if task.phase in SCHEDULE_PHASES
    ]
    return Schedule.build(steps, infos, batch, graph.network)
