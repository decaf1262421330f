"""Micro-batches: a step's batch cut into slices that each run the forward and backward tasks.

`micro_batched(graph, count)` rewrites a lowered step into one whose batch-carrying work runs
once per micro-batch, in the region model, as GPipe and PipeDream run it:

- *Per-micro-batch tensors.* Every tensor that carries the batch in dim 0 (the step's data,
  activations and their gradients) becomes one tensor per micro-batch, `name@m`, of the
  micro-batch's rows. Its buffers live from the micro-batch's first task to its last, so a
  schedule that finishes a micro-batch's backward before starting many forwards holds fewer
  of them at once (`SCHEDULES`).
- *Per-micro-batch tasks.* Every task that touches such a tensor runs once per micro-batch,
  `name@m`, over the micro-batch's rows of its space; its requirements come from the op's access
  map over the new space, as lowering makes them. It keeps its layer and its attributes, with
  `micro_batch` added (the copies of a layer's tasks make one unit, `partitioner.strategy.
  find_units`, so a strategy's grids apply to every micro-batch alike), and `batch_offset`
  (the micro-batch's first row in the step's batch) for the kernels whose result depends on
  where a sample sits (`in_step_batch`): the data task loads those rows, dropout draws those samples' masks.
- *Shared tensors and tasks.* Parameters, their gradients, the optimizer's state and the
  step's statistics (the loss, the evaluation's counts) stay one tensor. Each micro-batch's
  backward adds its share into the parameters' gradients (they are reductions already), and the
  loss is a mean over the step's whole batch (`batch_total`), so the step computes what the
  full-batch step does, up to the order of its sums. The zeroing of a shared tensor runs once,
  before every micro-batch; the updates and whatever reads the statistics run once, after.

Batch normalisation is the exception, as in every pipeline: its statistics are each
micro-batch's own.

The graph is sequential, like any: the order of its task list is the schedule, and the
dependences its requirements imply make any rank's reordering safe.
"""

from __future__ import annotations

from dataclasses import replace

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task, Tensor
from legion_nn.rect import Rect, split_bounds
from legion_nn.registry import piece_requirements

#: the orders in which one stage runs its micro-batches' forwards (F) and backwards (B):
#: `1f1b` runs each micro-batch's backward right after its forward, so one micro-batch's
#: activations are live at a time; `gpipe` runs every forward, then every backward
SCHEDULES = ("1f1b", "gpipe")

#: the tensor kinds that carry the batch in dim 0
BATCH_KINDS = ("data", "activation")


def micro_batched(graph: TaskGraph, count: int, schedule: str = "1f1b") -> TaskGraph:
    """`graph` with its batch run as `count` micro-batches in `schedule`'s order (see the module
    docstring); one micro-batch is `graph` itself."""
    check_micro_batches(count, graph.batch, schedule)
    if count == 1:
        return graph
    batched = _batch_tensors(graph)
    rows = split_bounds(0, graph.batch, count)
    tensors = [t for name, t in graph.tensors.items() if name not in batched]
    for m, (lo, hi) in enumerate(rows):
        tensors.extend(
            _sliced_tensor(graph.tensors[name], m, hi - lo, graph.batch) for name in batched
        )
    per_batch = [i for i, task in enumerate(graph.tasks) if _touches(task, batched)]
    first_backward = next(
        (i for i in per_batch if graph.tasks[i].phase == "backward"), len(graph.tasks)
    )
    forward = [i for i in per_batch if i < first_backward]
    backward = [i for i in per_batch if i >= first_backward]
    before, after = _shared_tasks(graph, set(per_batch), batched)
    sliced = {
        (m, i): _sliced_task(graph, graph.tasks[i], m, lo, hi, batched)
        for m, (lo, hi) in enumerate(rows)
        for i in per_batch
    }
    order: list[Task] = [graph.tasks[i] for i in before]
    if schedule == "gpipe":
        order += [sliced[m, i] for m in range(count) for i in forward]
        order += [sliced[m, i] for m in range(count) for i in backward]
    else:
        order += [sliced[m, i] for m in range(count) for i in (*forward, *backward)]
    order += [graph.tasks[i] for i in after]
    return TaskGraph(tensors, order, network=graph.network, batch=graph.batch)


def schedule_of(graph: TaskGraph) -> tuple[int, str | None]:
    """(micro-batches, schedule) of a graph `micro_batched` made, read from its tasks; (1, None)
    for any other graph."""
    seen = [t for t in graph.tasks if "micro_batch" in t.attrs and t.phase != "set_zero"]
    if not seen:
        return 1, None
    count = max(t.attrs["micro_batch"] for t in seen) + 1
    first_backward = next(i for i, t in enumerate(seen) if t.phase == "backward")
    second = next(i for i, t in enumerate(seen) if t.attrs["micro_batch"] == 1)
    return count, "1f1b" if first_backward < second else "gpipe"


def check_micro_batches(count: int, batch: int, schedule: str = "1f1b") -> None:
    """Raise `LegionNNError` naming the flag where `count` micro-batches of a batch of `batch`
    samples in `schedule`'s order cannot be run."""
    if schedule not in SCHEDULES:
        raise LegionNNError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if count < 1:
        raise LegionNNError(f"--micro-batches must be at least 1, got {count}")
    if count > batch:
        raise LegionNNError(f"--micro-batches {count} is larger than the batch of {batch} samples")


def micro_name(name: str, micro_batch: int) -> str:
    """The name of micro-batch `micro_batch`'s copy of a tensor or task: `@m` after the name of
    what it serves, so that a gradient's copy is the gradient of the copy (`X@m.grad`, from
    `X.grad`) and a backward task's copy the backward of the forward's (`L0.filter@m.grad`)."""
    head, dot, tail = name.partition(".grad")
    return f"{head}@{micro_batch}{dot}{tail}"


def in_step_batch(
    task: Task, lo: tuple[int, ...], dims: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A piece's first element `lo` in a tensor of `dims`, placed in the step's whole batch: for
    a micro-batch's task, shifted by the micro-batch's first row, the tensor as tall as the
    step's batch; for any other task, as given."""
    offset = task.attrs.get("batch_offset")
    if offset is None:
        return tuple(lo), tuple(dims)
    return (lo[0] + offset, *lo[1:]), (task.attrs["batch_total"], *dims[1:])


def _batch_tensors(graph: TaskGraph) -> set[str]:
    """The tensors that carry the batch in dim 0: data, activations and their gradients."""
    found = set()
    for name, tensor in graph.tensors.items():
        base = graph.tensors.get(name.removesuffix(".grad")) if tensor.kind == "grad" else tensor
        if base is None or base.kind not in BATCH_KINDS:
            continue
        if not tensor.dims or tensor.dims[0] != graph.batch:
            raise LegionNNError(
                f"tensor {name} ({tensor.kind}, dims {list(tensor.dims)}) does not carry the batch "
                f"of {graph.batch} in dim 0, so it cannot be cut into micro-batches"
            )
        found.add(name)
    return found


def _touches(task: Task, batched: set[str]) -> bool:
    return any(req.tensor in batched for req in task.requirements)


def _shared_tasks(
    graph: TaskGraph, per_batch: set[int], batched: set[str]
) -> tuple[list[int], list[int]]:
    """The tasks that run once, split into those that go before every micro-batch (some later
    per-micro-batch task reads or adds into what they write: the zeroing of a parameter's
    gradient, of the loss) and those that go after (the updates, what reads the statistics)."""
    before, after = [], []
    for i, task in enumerate(graph.tasks):
        if i in per_batch:
            continue
        written = {req.tensor for req in task.requirements if req.write_rect is not None}
        needed = any(
            req.tensor in written for j in per_batch if j > i for req in graph.tasks[j].requirements
        )
        (before if needed else after).append(i)
    return before, after


def _sliced_tensor(tensor: Tensor, micro_batch: int, rows: int, batch: int) -> Tensor:
    nbytes = tensor.nbytes_override
    return replace(
        tensor,
        name=micro_name(tensor.name, micro_batch),
        dims=(rows, *tensor.dims[1:]),
        nbytes_override=None if nbytes is None else nbytes * rows // batch,
    )


def _sliced_task(
    graph: TaskGraph, task: Task, micro_batch: int, lo: int, hi: int, batched: set[str]
) -> Task:
    """Micro-batch `micro_batch`'s copy of `task`: rows [lo, hi) of the step's batch."""
    space = task.space
    if space.ndim == 0 or space.lo[0] != 0 or space.hi[0] != graph.batch:
        raise LegionNNError(
            f"task {task.name} ({task.op}) touches the batch but does not iterate over it in dim "
            f"0 of its space {list(space.hi)}, so it cannot be cut into micro-batches"
        )
    rows = hi - lo
    new_space = Rect((0, *space.lo[1:]), (rows, *space.hi[1:]))

    def rename(tensor: str) -> str:
        return micro_name(tensor, micro_batch) if tensor in batched else tensor

    tensors = {rename(req.tensor): graph.tensors[req.tensor] for req in task.requirements}
    tensors = {
        name: (_sliced_tensor(t, micro_batch, rows, graph.batch) if t.name in batched else t)
        for name, t in tensors.items()
    }
    renamed = task.with_requirements(
        tuple(replace(req, tensor=rename(req.tensor)) for req in task.requirements)
    )
    requirements = piece_requirements(renamed, tensors, new_space)
    by_role = {req.role: req.rect for req in requirements}
    dist = {}
    for role, rect in task.dist.items():
        if role == "result":
            dist[role] = new_space if rect == space else rect
        else:
            dist[role] = by_role.get(role, rect)
    return replace(
        renamed,
        name=micro_name(task.name, micro_batch),
        requirements=requirements,
        space=new_space,
        dist=dist,
        result_dim=dist["result"].shape if "result" in dist else task.result_dim,
        attrs={
            **task.attrs,
            "micro_batch": micro_batch,
            "batch_offset": lo,
            "batch_total": graph.batch,
        },
    )
