"""Gradient clipping by the norm over every parameter, as `torch.nn.utils.clip_grad_norm_`.

Every gradient the updates take is scaled by min(1, C / (‖g‖₂ + 1e-6)), where ‖g‖₂ is the norm of
all the step's parameter gradients together. Under any plan that norm is the whole model's, never
a rank's: each rank adds up the squares of the gradient pieces its updates read, each piece counted
by one rank only (the first holder of a replicated piece: a parameter every rank holds is counted
once, a sharded or split one piece by piece), and the ranks sum those (`RankExecutor.sum_over_ranks`).

The norm needs every gradient summed before any update runs, so a clipped step:
- keeps its updates apart from the kernels that compute their gradients (a fused update steps
  while its gradient is still being formed: `runtime.step.update_fusion`);
- completes every collective in flight once its last non-update task is done, then takes the
  norm, then runs its updates with the factor (`StepContext.grad_scale`). Every rank runs its
  updates after all else (`runtime.step.order`), so no rank waits on another's update meanwhile.
"""

from __future__ import annotations

import math

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.rect import Rect
from partitioner.plan import Plan
from runtime.step.rank_program import RankProgram

#: what PyTorch adds to the norm before dividing by it
EPSILON = 1e-6


def counted_gradients(graph: TaskGraph, plan: Plan, rank: int) -> list[tuple[str, Rect]]:
    """The (gradient, rect) pieces whose squares `rank` adds to the norm: those of the plan's
    update pieces it runs and is the first holder of."""
    updates = {task.name for task in graph.tasks if task.op == "update"}
    counted = []
    for task_plan in plan.tasks:
        if task_plan.task not in updates:
            continue
        for piece in task_plan.pieces:
            if piece.ranks and min(piece.ranks) == rank:
                gradient = next(r for r in piece.requirements if r.role == "gradient")
                if gradient.read_rect is not None and not gradient.read_rect.is_empty():
                    counted.append((gradient.tensor, gradient.read_rect))
    return counted


def first_update(program: RankProgram) -> int:
    """The position in `program` from which only updates run (its length if none): where the
    norm is taken. An update that another task waits for (which `step_order` could not defer)
    leaves no such point, and clipping is refused."""
    updates = [rt.index for rt in program.tasks if rt.task.op == "update"]
    if not updates:
        return len(program.tasks)
    first = updates[0]
    after = [rt.task.name for rt in program.tasks[first:] if rt.task.op != "update"]
    if after:
        raise LegionNNError(
            f"--clip-grad-norm: task {after[0]} runs after an update, so the gradients' norm "
            "cannot be taken before every update"
        )
    return first


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor on every gradient: min(1, max_norm / (norm + 1e-6)); NaN where the norm is
    (PyTorch's clamp keeps a NaN too, so a diverged step shows in the weights)."""
    factor = max_norm / (norm + EPSILON)
    return factor if math.isnan(factor) else min(1.0, factor)
