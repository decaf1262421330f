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
  find_units`, so a strategy's grids apply to every micro-batch alike), and `batch_offset` and
  `batch_rows` (the micro-batch's first row in the step's batch, and that batch's rows) for the
  kernels whose result depends on where a sample sits (`in_step_batch`): the data task loads
  those rows, dropout draws those samples' masks. None of these changes a kernel's work
  (`PLACEMENT_ATTRS`), so a machine's timed pieces price the copies.
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

from collections.abc import Mapping
from dataclasses import replace

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task, Tensor
from legion_nn.rect import Rect, split_bounds
from legion_nn.registry import piece_requirements, weight_grad_roles

#: the orders in which one stage runs its micro-batches' forwards (F) and backwards (B):
#: `1f1b` runs each micro-batch's backward right after its forward, so one micro-batch's
#: activations are live at a time; `gpipe` runs every forward, then every backward. With
#: `DEFERRED` after either, the backwards compute the input gradients only where a layer's op
#: can leave its weights' gradients apart (`registry`'s `weight_grad`: `linear`, `dense`), and each
#: stage ends with one task per such layer computing them over all its micro-batches' rows
#: (zero-bubble pipelines' B and W passes): one product over the step's batch where each
#: micro-batch's would read and write the whole gradient, its update fused into it as without
#: micro-batches; the micro-batches' inputs and output gradients live until then
DEFERRED = "-deferred"
SCHEDULES = ("1f1b", "gpipe", "1f1b" + DEFERRED, "gpipe" + DEFERRED)

#: the attributes that say where a micro-batch's task sits in the step, not what its kernel
#: computes (the keys of a machine's piece table leave them out, `partitioner.machine_file`)
PLACEMENT_ATTRS = ("micro_batch", "schedule", "batch_offset", "batch_rows", "stage")

#: the tensor kinds that carry the batch in dim 0
BATCH_KINDS = ("data", "activation")


def micro_batched(
    graph: TaskGraph,
    count: int,
    schedule: str = "1f1b",
    stage_of: Mapping[str, int] | None = None,
) -> TaskGraph:
    """`graph` with its batch run as `count` micro-batches in `schedule`'s order (see the module
    docstring); one micro-batch in one stage is `graph` itself. `stage_of` names each task's
    pipeline stage (`partitioner.pipeline`), each stage running `schedule` (`stage_order`), the
    task list one program holding every stage's order; by default one stage runs everything."""
    check_micro_batches(count, graph.batch, schedule)
    if count == 1 and not any((stage_of or {}).values()):
        return graph
    batched = _batch_tensors(graph)
    rows = split_bounds(0, graph.batch, count)
    tensors = {name: t for name, t in graph.tensors.items() if name not in batched}
    for m, (lo, hi) in enumerate(rows):
        for name in batched:
            sliced_tensor = _sliced_tensor(graph.tensors[name], m, hi - lo, graph.batch)
            tensors[sliced_tensor.name] = sliced_tensor
    per_batch = [i for i, task in enumerate(graph.tasks) if _touches(task, batched)]
    first_backward = next(
        (i for i in per_batch if graph.tasks[i].phase == "backward"), len(graph.tasks)
    )
    before, after = _shared_tasks(graph, set(per_batch), batched)
    stage = {i: (stage_of or {}).get(graph.tasks[i].name, 0) for i in per_batch}
    stages = max(stage.values(), default=0) + 1
    copied = {i: graph.tasks[i] for i in per_batch}
    deferred: list[Task] = []
    if schedule.endswith(DEFERRED):
        sizes = tuple(hi - lo for lo, hi in rows)
        for i in per_batch:
            split = _deferred(graph.tasks[i], sizes, batched, tensors, schedule)
            if split is not None:
                copied[i], weights = split
                if stage_of is not None:
                    weights.attrs["stage"] = stage[i]
                deferred.append(weights)
    per_batch = [i for i in per_batch if copied[i] is not None]
    sliced = {}
    for m, (lo, hi) in enumerate(rows):
        for i in per_batch:
            task = _sliced_task(graph, copied[i], m, lo, hi, batched, tensors, schedule)
            if stage_of is not None:
                task.attrs["stage"] = stage[i]
            sliced[m, i] = task
    # a gradient's zeroing in the backwards goes just before the first task to add into it,
    # whichever stage that runs on: the sequential order's meaning, kept in the merge
    anchored: dict[int, list[int]] = {}
    passes: dict[tuple[str, int], list[int]] = {("F", s): [] for s in range(stages)}
    passes.update({("B", s): [] for s in range(stages)})
    for i in per_batch:
        task = graph.tasks[i]
        if i >= first_backward and task.phase == "set_zero":
            anchored.setdefault(_first_user(graph, i, per_batch), []).append(i)
        else:
            passes["F" if i < first_backward else "B", stage[i]].append(i)
    order: list[Task] = [graph.tasks[i] for i in before]
    for kind, s, m in _merge(stages, count, schedule):
        for i in passes[kind, s]:
            order += [sliced[m, z] for z in anchored.get(i, ())]
            order.append(sliced[m, i])
    order += deferred + [graph.tasks[i] for i in after]
    return TaskGraph(tensors.values(), order, network=graph.network, batch=graph.batch)


def defers_weight_grads(graph: TaskGraph) -> bool:
    """Whether a `DEFERRED` schedule changes `graph`'s step: some backward's op can leave its
    weights' gradients apart."""
    return any(weight_grad_roles(t) is not None for t in graph.tasks)


def stage_order(stage: int, stages: int, count: int, schedule: str) -> list[tuple[str, int]]:
    """The passes stage `stage` of `stages` runs, in order: ("F", m) the forward of micro-batch
    m, ("B", m) its backward. GPipe: every forward, then every backward. 1F1B: `stages - 1 -
    stage` forwards ahead, then a forward and a backward in turn, then the backwards left."""
    if schedule.removesuffix(DEFERRED) == "gpipe":
        return [("F", m) for m in range(count)] + [("B", m) for m in range(count)]
    ahead = min(stages - 1 - stage, count)
    out = [("F", m) for m in range(ahead)]
    for m in range(count - ahead):
        out += [("F", ahead + m), ("B", m)]
    return out + [("B", m) for m in range(count - ahead, count)]


#: a pass's length in `_merge`'s timeline, in forwards: a backward computes two products (the
#: input's gradient and the parameters') for the forward's one
PASS_LENGTH = {"F": 1, "B": 2}


def _merge(stages: int, count: int, schedule: str) -> list[tuple[str, int, int]]:
    """Every stage's passes (`stage_order`) as one sequence (kind, stage, micro-batch), in the
    order they end when each stage runs its order as early as it may (`PASS_LENGTH`): a forward
    after the previous stage's forward of its micro-batch, a backward after its own forward and
    the next stage's backward. Ties go to the earlier stage.

    A rank waits for another stage's result at that pass's place in the sequence (a partial sum
    into a tensor it holds is added there), so a pass goes after every pass that ends before it:
    a rank then never waits on a later micro-batch's result while it could compute."""
    orders = [stage_order(s, stages, count, schedule) for s in range(stages)]
    at = [0] * stages
    free = [0] * stages
    ends: dict[tuple[str, int, int], int] = {}
    while len(ends) < stages * 2 * count:
        moved = False
        for s in range(stages):
            while at[s] < len(orders[s]):
                kind, m = orders[s][at[s]]
                if kind == "F":
                    needs = [("F", s - 1, m)] if s else []
                else:
                    needs = [("F", s, m)] + ([("B", s + 1, m)] if s < stages - 1 else [])
                if any(need not in ends for need in needs):
                    break
                start = max([free[s]] + [ends[need] for need in needs])
                free[s] = ends[kind, s, m] = start + PASS_LENGTH[kind]
                at[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"schedule {schedule} deadlocks on {stages} stages")
    return sorted(ends, key=lambda p: (ends[p], p[1]))


def _first_user(graph: TaskGraph, index: int, candidates: list[int]) -> int:
    """The first task after `index` (among `candidates`) that touches what it writes."""
    written = {req.tensor for req in graph.tasks[index].requirements}
    return next(
        j
        for j in candidates
        if j > index and any(req.tensor in written for req in graph.tasks[j].requirements)
    )


def schedule_of(graph: TaskGraph) -> tuple[int, str | None]:
    """(micro-batches, schedule) of a graph `micro_batched` made, read from its tasks; (1, None)
    for any other graph."""
    seen = [t for t in graph.tasks if "micro_batch" in t.attrs]
    if not seen:
        return 1, None
    return max(t.attrs["micro_batch"] for t in seen) + 1, seen[0].attrs["schedule"]


def stages_of(graph: TaskGraph) -> int:
    """The pipeline stages of a graph `micro_batched` made with stages (each task's `stage`);
    1 for any other graph."""
    return 1 + max((t.attrs.get("stage", 0) for t in graph.tasks), default=0)


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
    return (lo[0] + offset, *lo[1:]), (task.attrs["batch_rows"], *dims[1:])


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


def _deferred(
    task: Task,
    rows: tuple[int, ...],
    batched: set[str],
    tensors: Mapping[str, Tensor],
    schedule: str,
) -> tuple[Task | None, Task] | None:
    """(what each micro-batch's copy of backward `task` computes, or None where that is
    nothing; the task computing its weights' gradients over micro-batches of `rows` rows) where
    its op can defer them (`registry`'s `weight_grad`), else None."""
    roles = weight_grad_roles(task)  # a backward's, where its op can defer them
    if roles is None:
        return None
    weight_roles, input_roles = roles
    rest = [req for req in task.requirements if req.role in input_roles]
    copy = None
    if any(req.privilege.writes for req in rest):
        copy = replace(task.with_requirements(tuple(rest)), attrs={**task.attrs, "need_dw": False})
    needs = []
    for req in task.requirements:
        if req.role not in weight_roles:
            continue
        if req.tensor not in batched:
            needs.append(req)
            continue
        for m in range(len(rows)):
            needs.append(replace(req, tensor=micro_name(req.tensor, m), role=f"{req.role}@{m}"))
    space = Rect((0, *task.space.lo[1:]), (max(rows), *task.space.hi[1:]))
    weights = replace(
        task,
        requirements=tuple(needs),
        space=space,
        dist={role: rect for role, rect in task.dist.items() if role == "result"},
        attrs={**task.attrs, "need_dx": False, "micro_rows": rows, "schedule": schedule},
    )
    weights = weights.with_requirements(piece_requirements(weights, tensors, space))
    return copy, weights


def _sliced_task(
    graph: TaskGraph,
    task: Task,
    micro_batch: int,
    lo: int,
    hi: int,
    batched: set[str],
    tensors: Mapping[str, Tensor],
    schedule: str,
) -> Task:
    """Micro-batch `micro_batch`'s copy of `task`: rows [lo, hi) of the step's batch, over
    `tensors`, the micro-batched step's."""
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
            "schedule": schedule,
            "batch_offset": lo,
            "batch_rows": graph.batch,
        },
    )
