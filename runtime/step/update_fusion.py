"""Updates fused into the kernels that compute their gradients, on one rank's program.

An optimizer's update reads a weight-sized gradient that the backward task wrote just before:
two passes over it through memory, and a buffer the size of the weights. Where the task's
kernel can take the step itself (its op's `stepped_role`, `legion_nn.registry`), the update is
fused into it: the kernel steps the weights block by block while each block of the gradient is
in cache (`runtime.kernels.update`), and the gradient is never stored, so it gets no buffer.

Only where nothing can tell the difference, on this rank's program as built:

- the task's one piece here writes the whole gradient (`RankTask.fresh`, its zeroing elided)
  from its stepped role, and adds none of it elsewhere: no collective, partial sum or scratch
  (a data-parallel gradient, which an all-reduce sums first, stays stored);
- this rank runs the update's one piece over exactly that rect, taking nothing from other ranks;
- no task between the two touches the gradient, the parameter or its state, and neither task
  nor any between sends or receives them (so no rank reads the parameter early);
- no other task of the graph, here or on another rank, reads the gradient.

The task that writes the gradient reads the parameter too (a backward's input gradient); its
adapter computes that before its kernel steps the weights.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import chain

from legion_nn.graph import TaskGraph
from legion_nn.op_records import stepped_role
from runtime.step.rank_messages import tensor_and_task_of, tensor_of
from runtime.step.rank_program import RankProgram, RankTask


def fuse_into_gradients(graph: TaskGraph, program: RankProgram) -> None:
    """Fuse each update of `program` that can be into the task that writes its gradient:
    `RankTask.steps` on that task, `RankTask.fused_into` on the update, and the gradient's
    buffer dropped from `program.boxes`."""
    #: per tensor, the positions of the tasks that touch it, in order
    touching: dict[str, list[int]] = {}
    for rt in program.tasks:
        for name in rt.tensors:
            touching.setdefault(name, []).append(rt.index)
    #: per tensor, the consumers' positions of its messages posted, sorted (found when first
    #: asked: a model-parallel rank of many posts 10⁴ messages, which each update scanned)
    posted: dict[str, list[int]] | None = None
    for update in program.tasks:
        if update.task.op != "update" or len(update.pieces) != 1 or update.windows:
            continue
        by_role = {req.role: req for req in update.pieces[0].requirements}
        gradient = by_role.get("gradient")
        if gradient is None or by_role["params"].rect != gradient.rect:
            continue
        found = _writer(program, touching.get(gradient.tensor, []), gradient.tensor, update.index)
        if found is None:
            continue
        producer, role = found
        written = next(r for r in producer.pieces[0].requirements if r.role == role)
        if written.write_rect != gradient.read_rect:
            continue
        if not _untouched_between(program, producer, update) or not _read_only_by(
            graph, gradient.tensor, {producer.task.name, update.task.name}
        ):
            continue
        if posted is None:
            posted = _posted_by_tensor(program)
        if not _posted_within(posted, update, producer.index, update.index):
            producer.steps[role] = update.index
            update.fused_into = producer.index
            program.boxes.pop(gradient.tensor, None)


def _writer(
    program: RankProgram, touching: list[int], gradient: str, before: int
) -> tuple[RankTask, str] | None:
    """The task before position `before` whose one piece wrote all of `gradient` here from its
    op's stepped role, adding none of it elsewhere, and that role; None if the last task to
    touch the gradient is not one. `touching`: the positions of the tasks that touch it."""
    for position in reversed(touching[: bisect_left(touching, before)]):
        rt = program.tasks[position]
        if rt.task.op == "set_zero":
            continue
        role = stepped_role(rt.task)
        if role is None or gradient not in rt.fresh or len(rt.pieces) != 1:
            return None
        if not any(r.role == role and r.tensor == gradient for r in rt.pieces[0].requirements):
            return None
        summed = {c.reduction.tensor for c in rt.collectives}
        sent = {m.tensor for m in rt.partial_out}
        if gradient in summed | sent | rt.in_place or gradient in rt.local_parts:
            return None
        return rt, role
    return None


def _untouched_between(program: RankProgram, producer: RankTask, update: RankTask) -> bool:
    """Whether nothing touches the update's tensors from the producer to the update: no task
    between them, no collective of theirs, and no message of theirs received, summed or
    posted then (`_posted_within` asks of those posted earlier)."""
    names = {req.tensor for req in update.pieces[0].requirements}
    between = program.tasks[producer.index + 1 : update.index]
    # a task's `tensors` hold its messages' and collectives' too
    if any(names & rt.tensors for rt in between) or update.collectives:
        return False
    for rt in (producer, update):
        moved = chain(rt.copies_in, rt.partial_in, rt.partial_out, rt.post)
        summed = {c.reduction.tensor for c in rt.collectives}
        if names & (set(map(tensor_of, moved)) | summed):  # in C: 10⁴ messages a task
            return False
    return True


def _posted_by_tensor(program: RankProgram) -> dict[str, list[int]]:
    """Per tensor, the positions of the tasks that consume the messages of it that `program`
    posts, sorted (each once)."""
    posts = chain(program.post_at_start, chain.from_iterable(rt.post for rt in program.tasks))
    found: dict[str, list[int]] = {}
    for tensor, task in set(map(tensor_and_task_of, posts)):  # in C: 10⁴ messages a rank
        found.setdefault(tensor, []).append(task)
    for tasks in found.values():
        tasks.sort()
    return found


def _posted_within(posted: dict[str, list[int]], update: RankTask, first: int, last: int) -> bool:
    """Whether a message of the update's tensors that this rank posts is consumed from
    position `first` to `last` (a copy of the weights posted earlier, for a reader on another
    rank in between, would send them stepped)."""
    for req in update.pieces[0].requirements:
        tasks = posted.get(req.tensor, ())
        at = bisect_left(tasks, first)
        if at < len(tasks) and tasks[at] <= last:
            return True
    return False


def _read_only_by(graph: TaskGraph, gradient: str, tasks: set[str]) -> bool:
    """Whether `tasks` are the only tasks of the graph, zeroings aside, that touch `gradient`."""
    users = graph.producers(gradient) + graph.consumers(gradient)
    return {t.name for t in users if t.op != "set_zero"} == tasks
