"""A task's piece run on views of its requirements: the kernel its op's adapter names, and the
results written into the views or added to them (`runtime.adapters`).

The rank executor runs every piece so (`runtime.rank_step`), over views of its buffers; the
tests and `bench.task_profile` run pieces on views of whole arrays.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.op_records import piece_requirements
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.reduction_split import as_partial_sums
from runtime.adapters import StepContext, run_piece


def run_task_piece(
    task: Task,
    piece: Rect,
    tensors: dict[str, Tensor],
    view,
    ctx: StepContext,
    partial: bool = False,
) -> None:
    """Run one piece of a task: views in, kernel, results written or reduced into the views.

    `view(tensor_name, rect)` returns a writable array for that rect of the tensor. A `partial`
    piece covers part of a dim the task sums over: its writes are partial sums, added into
    their views (which the caller zeroed)."""
    requirements = piece_requirements(task, tensors, piece)
    if partial:
        requirements = as_partial_sums(requirements)
    views = {req.role: view(req.tensor, req.rect) for req in requirements}
    run_on_views(task, piece, requirements, views, tensors, ctx)


def run_on_views(
    task: Task,
    piece: Rect,
    requirements: Iterable[Requirement],
    views: dict[str, np.ndarray],
    tensors: dict[str, Tensor],
    ctx: StepContext,
) -> None:
    """The kernel of a piece on given views; a `write` view is overwritten, a `reduce` one added to
    (or overwritten, where `ctx.fresh` names it: the first contribution since an elided zeroing).

    The rank executor hands a piece's reductions zeroed scratch views where the sums must be split
    between ranks, so what accumulates there is exactly the piece's contribution. A role whose
    rect the piece does not touch gets no view: a bias, which only the piece starting a sum over
    a reduction dim adds, or a sparse update's channels outside the piece's."""
    requirements = tuple(requirements)
    dims = {req.role: tensors[req.tensor].dims for req in requirements}
    views = {role: view for role, view in views.items() if view.size}
    results = run_piece(task, piece, views, dims, ctx)
    for req in requirements:
        if req.role not in results:
            continue
        if req.role not in views:
            raise AssertionError(f"{task.name}: adapter returned role {req.role} it has no view of")
        target = views[req.role]
        if req.privilege is Privilege.REDUCE and req.role not in ctx.fresh:
            target += results[req.role]
        elif req.privilege is Privilege.REDUCE or req.privilege is Privilege.WRITE:
            target[...] = results[req.role]
        else:
            raise AssertionError(f"{task.name}: adapter returned a {req.privilege} role {req.role}")
