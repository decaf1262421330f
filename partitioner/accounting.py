"""FLOPs and memory per rank of a plan.

FLOPs are counted per element of a task's iteration space, by op and phase (multiply and add count
as two): a filter output reads C·R·S inputs (2·C·R·S forward; backward computes the input and the
weight gradient, twice that, or once when the input needs no gradient); a `linear` output
2·C·H·W; elementwise ops a few; softmax and evaluate a few per class. `set_zero` and `data` count
none (they are memory traffic, a blind spot of the model); an update counts per element 2 (sgd),
4 (momentum), 10 (adam). A homed piece is computed by every holder.

Memory per rank is everything the rank holds at any point of the step, with no reuse: its cells of
every tensor's layouts (activations, gradients, the homes of data, parameters, their gradients and
optimizer state, replicated or not) plus the parts it receives for a read and the partial sums it
holds for a reduction into a rect it does not own. This bounds the peak from above.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from partitioner.plan import Plan

UPDATE_FLOPS = {"sgd": 2, "momentum": 4, "adam": 10}


def _window(task: Task, graph: TaskGraph) -> int:
    dims = graph.tensors[task.requirement("filters").tensor].dims
    return dims[3] * dims[4] * dims[5]


def _fan_in(task: Task, graph: TaskGraph) -> int:
    _, c, h, w = graph.tensors[task.requirement("input").tensor].dims
    return c * h * w


def _classes(task: Task, graph: TaskGraph) -> int:
    role = "input" if task.op == "softmax" else "probability"
    return graph.tensors[task.requirement(role).tensor].dims[1]


def _backward_factor(task: Task) -> int:
    return 4 if task.attrs.get("need_dx", True) else 2


FLOPS_PER_ELEMENT: dict[tuple[str, str], Callable[[Task, TaskGraph], float]] = {
    ("filter", "forward"): lambda t, g: 2 * _window(t, g),
    ("filter", "backward"): lambda t, g: _backward_factor(t) * _window(t, g),
    ("conv", "forward"): lambda t, g: 2 * _window(t, g) + 1,
    ("conv", "backward"): lambda t, g: _backward_factor(t) * _window(t, g) + 1,
    ("linear", "forward"): lambda t, g: 2 * _fan_in(t, g),
    ("linear", "backward"): lambda t, g: _backward_factor(t) * _fan_in(t, g),
    ("filterA", "forward"): lambda t, g: 2,
    ("filterA", "backward"): lambda t, g: 4,
    ("filterNL", "forward"): lambda t, g: 1,
    ("filterNL", "backward"): lambda t, g: 2,
    ("dropout", "forward"): lambda t, g: 2,
    ("dropout", "backward"): lambda t, g: 1,
    ("maxpool", "forward"): lambda t, g: t.attrs["kernel"][0] * t.attrs["kernel"][1],
    ("maxpool", "backward"): lambda t, g: t.attrs["kernel"][0] * t.attrs["kernel"][1],
    ("softmax", "forward"): lambda t, g: 5 * _classes(t, g),
    ("softmax", "backward"): lambda t, g: 2,
    ("evaluate", "forward"): lambda t, g: 6 * _classes(t, g),
    ("update", "update"): lambda t, g: UPDATE_FLOPS.get(t.attrs.get("optimizer", "sgd"), 10),
}
DEFAULT_FLOPS = 8.0  # ops with no entry (batchnorm, reshape): a few per element


def flops_per_element(task: Task, graph: TaskGraph) -> float:
    if task.op in ("set_zero", "data", "accuracy"):
        return 0.0
    fn = FLOPS_PER_ELEMENT.get((task.op, task.phase))
    return float(fn(task, graph)) if fn else DEFAULT_FLOPS


def task_flops(graph: TaskGraph, plan: Plan) -> dict[str, dict[int, float]]:
    """FLOPs of every task on every rank that computes part of it."""
    out: dict[str, dict[int, float]] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        per = flops_per_element(task, graph)
        ranks: dict[int, float] = defaultdict(float)
        if per:
            for piece in task_plan.pieces:
                work = per * piece.rect.volume
                for rank in piece.ranks:
                    ranks[rank] += work
        out[task.name] = dict(ranks)
    return out


def memory_per_rank(graph: TaskGraph, plan: Plan) -> dict[int, int]:
    """Bytes each rank holds over the step (see the module docstring)."""
    held: dict[int, int] = defaultdict(int)
    for name, layout in plan.layouts.items():
        itemsize = graph.tensors[name].itemsize
        for rank, volume in layout.volumes_by_rank().items():
            held[rank] += volume * itemsize
    for name, layout in plan.homes.items():
        if name not in plan.layouts or plan.layouts[name] is not layout:
            itemsize = graph.tensors[name].itemsize
            for rank, volume in layout.volumes_by_rank().items():
                held[rank] += volume * itemsize
    seen: set[tuple[str, object, int]] = set()
    for task_plan in plan.tasks:
        for transfer in task_plan.transfers:
            if transfer.reduce:
                continue
            for dst in transfer.dsts:
                key = (transfer.tensor, transfer.rect, dst)
                if key not in seen:
                    seen.add(key)
                    held[dst] += transfer.nbytes
        for transfer in task_plan.transfers:
            if transfer.reduce:
                held[transfer.src] += transfer.nbytes
        for reduction in task_plan.reductions:
            owned: dict[int, int] = defaultdict(int)
            for rect, holders in reduction.targets:
                for rank in holders:
                    owned[rank] += rect.volume * reduction.itemsize
            for rank in reduction.participants:
                held[rank] += reduction.nbytes - owned[rank]
    for rank in range(plan.nranks):
        held.setdefault(rank, 0)
    return dict(held)
