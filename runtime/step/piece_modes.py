"""How a step runs a piece beyond its task's kernel, and what that costs from a machine's table.

A piece that reduces into a gradient adds its results to what the gradient holds, unless its
rank's program says otherwise:

- it is the first contribution since an elided zeroing (`RankTask.fresh`): it writes them;
- the update of its gradient is fused into it (`RankTask.steps`): its kernel takes the
  optimizer's step block by block and stores no gradient, and the update does not run.

The kernels differ in what they cost: seed-lcn's classifier backward at batch 16 (a 566 MB
weight gradient, 2 threads) took 123 ms adding into its stored gradient, 24 ms more to zero
it and 57 ms for its update run alone, against 134 ms as the step runs it, writing nothing but
the weights it steps. `bench machine` times such pieces as the step runs them, keyed by their
`piece_mode`, and the step simulator prices them from those rows where the table has them
(`program_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.cost import task_seconds
from partitioner.machine import Machine
from partitioner.piece_times import piece_key
from runtime.step.rank_program import PieceWork, RankProgram, RankTask

if TYPE_CHECKING:
    from runtime.kernels.update import OptimizerStep


def fresh_roles(rt: RankTask, piece: PieceWork) -> frozenset[str]:
    """The roles `piece` of `rt` writes rather than adds to: the first contribution since a
    zeroing that was elided."""
    return frozenset(
        req.role
        for req in piece.requirements
        if req.privilege is Privilege.REDUCE and req.tensor in rt.fresh
    )


def fused_steps(
    program: RankProgram,
    rt: RankTask,
    view: Callable[[str, Rect], np.ndarray],
    step: int,
    lr_scale: float = 1.0,
) -> dict[str, OptimizerStep]:
    """Per gradient role of `rt`, the optimizer's step of the update fused into it, over the
    update's views (`view(tensor, rect)`) of the parameter and its state, at training `step`
    with the schedule's factor `lr_scale` on its learning rate. (Clipping, which scales the
    gradients by their norm over the whole step, keeps every update apart: `grad_clipping`.)"""
    # here, not at the top: predicting a step from these modules loads no kernel (no Numba)
    from runtime.kernels.update import optimizer_step

    steps = {}
    for role, position in rt.steps.items():
        update = program.tasks[position]
        (piece,) = update.pieces
        views = {req.role: view(req.tensor, req.rect) for req in piece.requirements
                 if req.role != "gradient"}  # fmt: skip
        steps[role] = optimizer_step(update.task.attrs, views, step, lr_scale)
    return steps


def piece_mode(program: RankProgram, rt: RankTask, piece: PieceWork) -> str | None:
    """How the step runs `piece` of `rt` where that is not adding into its reductions: the
    roles it writes and those whose optimizer's step it takes, with the optimizer (its step's
    work); None where it adds."""
    parts = [f"writes {role}" for role in sorted(fresh_roles(rt, piece))]
    parts += [
        f"steps {role} by {program.tasks[position].task.attrs['optimizer']}"
        for role, position in sorted(rt.steps.items())
    ]
    return "; ".join(parts) or None


def moded_seconds(program: RankProgram, rt: RankTask, table: Mapping[str, float]) -> float | None:
    """The seconds of `rt`'s pieces here as the step runs them, from the machine's `table`,
    where `rt` runs a piece in a mode (`piece_mode`) and the table has every piece of it; else
    None (the plain pieces' time stands)."""
    if not table or not rt.runs or not (rt.fresh or rt.steps):
        return None
    total = 0.0
    for piece in rt.pieces:
        key = piece_key(
            rt.task, piece.rect.shape, piece.requirements, piece_mode(program, rt, piece)
        )
        if key not in table:
            return None
        total += table[key]
    return total


def moded_times(program: RankProgram, table: Mapping[str, float]) -> dict[int, float]:
    """Per position of a task of `program` whose pieces run in a mode `table` has timed, their
    seconds there (`moded_seconds`)."""
    if not table:
        return {}
    found = ((position, moded_seconds(program, rt, table)) for position, rt in
             enumerate(program.tasks))  # fmt: skip
    return {position: seconds for position, seconds in found if seconds is not None}


def program_seconds(
    program: RankProgram,
    seconds: Sequence[float],
    machine: Machine,
    moded: Mapping[int, float] | None = None,
    share: float = 1.0,
) -> list[float]:
    """`seconds` of each task of `program` as the runtime runs them: an elided zeroing does not
    run; a task whose pieces run in a mode the machine's table has timed (`moded`, from
    `moded_times`) takes that time, its fused updates' included, times the compute factor and
    priced as any task (`cost.task_seconds`, over `share`, the rank's share of its cores); an
    update fused into a task not timed so has its kernel's time added to that task's, without a
    task of its own (so without its overhead)."""
    out = list(seconds)
    moded = moded_times(program, machine.pieces) if moded is None else moded
    for position, found in moded.items():
        out[position] = task_seconds(found * machine.compute_factor, machine, share)
    for position, rt in enumerate(program.tasks):
        if rt.fused_into is not None and rt.fused_into not in moded:
            out[rt.fused_into] += max(out[position] - machine.task_overhead, 0.0)
        if rt.fused_into is not None or rt.elided:
            out[position] = 0.0
    return out
