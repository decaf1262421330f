"""Measured compute: a machine's table of piece times, and a plan's compute read from it.

FlexFlow prices an operator configuration by running it once on the device. `legion-nn bench
machine` does the same for the pieces of a network's plans (`bench.task_profile` times them
with the runtime's kernels) and writes the times into the machine file (`"pieces"`). A piece is
known by what decides its kernel's work, not by its task's name, so the table serves any graph
with the same shapes:

    (op, phase, attrs, the piece's shape, each requirement's role and rect shape)

`compute_per_rank` reads a plan's compute from the table: each rank's sum over its pieces of
their seconds, times the machine's `compute_factor` (a kernel inside a running step is slower
than alone: its operands come from further out in the memory hierarchy), plus the runtime's
per-task overhead. A task with a piece the table lacks is priced by the FLOP and roofline model
(`cost.compute_per_rank`) instead, whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from partitioner.machine_file import piece_key_of
from partitioner.plan import Plan

PieceKey = str


def piece_key(
    task: Task, shape: tuple[int, ...], requirements, mode: str | None = None
) -> PieceKey:
    """The table's key of a piece of `task` of `shape` whose requirements (role, rect) are
    `requirements` (objects with `role` and `rect`, the rect None where the piece reads none),
    run in `mode` (`runtime.step.piece_modes.piece_mode`; None: adding into its reductions)."""
    return piece_key_of(
        task.op,
        task.phase,
        task.attrs,
        shape,
        [(r.role, None if r.rect is None else r.rect.shape) for r in requirements],
        mode,
    )


def task_piece_times(
    graph: TaskGraph, plan: Plan, table: Mapping[PieceKey, float]
) -> list[np.ndarray | None]:
    """Per task, each rank's seconds in its pieces from `table`; None for a task with a piece
    the table lacks."""
    out: list[np.ndarray | None] = []
    for task, task_plan in zip(graph.tasks, plan.tasks):
        seconds = np.zeros(plan.nranks)
        for piece in task_plan.pieces:
            key = piece_key(task, piece.rect.shape, piece.requirements)
            if key not in table:
                seconds = None
                break
            seconds[list(piece.ranks)] += table[key]
        out.append(seconds)
    return out


def working_ranks(plan: Plan, index: int) -> np.ndarray:
    """Which ranks have a piece of task `index`."""
    working = np.zeros(plan.nranks, bool)
    for piece_set in plan.tasks[index].piece_sets:
        working[piece_set.ranks] = True
    return working
