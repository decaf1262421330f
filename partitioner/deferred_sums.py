"""Sums deferred: tasks that add into one tensor in turn, combined across ranks once, at the last.

Micro-batches (`legion_nn.micro_batches`) make M backward tasks add into each parameter's
gradient, one after another, and nothing reads the gradient until the last has added. Planned
task by task, each would all-reduce its own partial sums: M collectives of the whole gradient
where one carries the same sum. As a Legion reduction instance folds later, each rank here
keeps adding its own partial sums into its own copy, and the last task's collective sums the
copies, each holding everything that rank added: Σ_ranks Σ_tasks = Σ_tasks Σ_ranks.

A task's sum into a tensor is deferred to the next task that touches the tensor where both:

- sum it with the same one collective: one target, which every participant holds whole (an
  all-reduce of a replicated gradient), and no partial sums sent point to point;
- have every participant contribute exactly the target, once.

Each rank then adds in place into its copy in every task of the chain, and the last task's
collective sums the copies in place (`runtime.step.rank_program`: the rank's copy holds nothing but
its own partial sums since it was zeroed). A chain follows itself: a task defers to the last
task of the chain (`TaskPlan.deferred`), whose collective `verify_plan` checks against every
contribution of the chain.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.task_plan import Reduction, TaskPlan


def defer_sums(graph: TaskGraph, plans: list[TaskPlan]) -> list[TaskPlan]:
    """`plans` with every sum that can wait for a later task's collective deferred to it (see
    the module docstring): its reductions dropped, the later task named in `deferred`."""
    touching: dict[str, list[int]] = defaultdict(list)
    for index, task in enumerate(graph.tasks):
        for tensor in dict.fromkeys(req.tensor for req in task.requirements):
            touching[tensor].append(index)
    #: (task index, tensor) -> the index of the task whose collective sums it
    carried: dict[tuple[int, str], int] = {}
    out = list(plans)
    for index in reversed(range(len(plans))):
        plan = plans[index]
        deferred = {}
        for tensor in dict.fromkeys(r.tensor for r in plan.reductions):
            later = touching[tensor]
            position = later.index(index)
            if position + 1 == len(later):
                continue
            following = later[position + 1]
            if _one_sum(plan, plans[following], tensor):
                deferred[tensor] = carried.get((following, tensor), following)
                carried[index, tensor] = deferred[tensor]
        if deferred:
            out[index] = plan.with_deferred(deferred)
    return out


def _one_sum(first: TaskPlan, then: TaskPlan, tensor: str) -> bool:
    """Whether `first`'s sum into `tensor` can wait for `then`'s collective."""
    mine = _reductions(first, tensor)
    if len(mine) != 1 or mine != _reductions(then, tensor):
        return False
    (reduction,) = mine
    if len(reduction.targets) != 1 or reduction.targets[0][1] != reduction.participants:
        return False
    target = reduction.targets[0][0]
    return all(
        _contributes_target(plan, tensor, reduction.participants, target) for plan in (first, then)
    )


def _reductions(plan: TaskPlan, tensor: str) -> list[Reduction]:
    return [r for r in plan.reductions if r.tensor == tensor]


def _contributes_target(
    plan: TaskPlan, tensor: str, participants: tuple[int, ...], target: Rect
) -> bool:
    """Every participant adds exactly `target` into `tensor`, once, and no partial sum of it
    travels point to point."""
    if any(b.reduce and b.tensor == tensor and len(b) for b in plan.transfer_set.blocks):
        return False
    owners, lo, hi = [], [], []
    for pieces in plan.piece_sets:
        for j, req in enumerate(pieces.requirements):
            if req.tensor == tensor and req.privilege is Privilege.REDUCE:
                if (np.diff(pieces.rank_ptr) != 1).any():  # a piece run by several ranks
                    return False
                owners.append(pieces.owners)
                lo.append(pieces.req_lo[j])
                hi.append(pieces.req_hi[j])
    if not owners:
        return False
    owners = np.concatenate(owners)
    if sorted(owners.tolist()) != sorted(participants):
        return False
    lo, hi = np.concatenate(lo), np.concatenate(hi)
    return bool((lo == np.asarray(target.lo)).all() and (hi == np.asarray(target.hi)).all())
