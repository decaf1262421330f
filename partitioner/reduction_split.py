"""Reduction splits: grids that cut the dims a task sums over, and where its partial sums land.

An op whose record sums over the last `sums_over` dims of its space (`linear` over the input's
C, H, W; `filter` and `conv` over the input channels) may be cut along them, as Legion cuts a
task whose region requirement has the reduction privilege and Megatron-LM splits its
row-parallel linear. A piece over part of a reduction dim computes a *partial sum* of its output:
its write becomes a `reduce` (`piece_requirements`), and the pieces that cover the same output
cell add up, in the plan, into the output's layout after the task, its *sum grid*
(`output_grid`). That is where the output lives for every later task: the other tasks of the
unit (a filter's bias and nonlinearity) run on it, and the output's gradient is zeroed on it.

The sum grid is the task's grid over its output dims with the reduction dims' parts moved onto
one output dim, so the partial sums of each output cell are scattered over the ranks that made
them (a reduce-scatter): onto the last output dim the grid cuts or a later one when it has room
(those keep each output cell's sum on the ranks of that cell, whose numbers, row-major,
are consecutive), batch first when the grid cuts no output dim; failing that, the largest share
each dim has room for.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod

import numpy as np

from legion_nn.ir import Requirement, Task
from legion_nn.op_records import output_ndim, splittable_dims
from legion_nn.privilege import Privilege
from partitioner import boxes

Grid = tuple[int, ...]


def cuts_sum(task: Task, grid: Grid) -> bool:
    """Whether `grid` cuts a dim `task` sums over, so its pieces write partial sums."""
    return any(parts > 1 for parts in grid[output_ndim(task) :])


def output_grid(task: Task, grid: Grid) -> Grid:
    """Where the output of `task` on `grid` lives after it: `grid` itself over the output dims
    unless it cuts a reduction dim, else the sum grid (see the module docstring)."""
    nout = output_ndim(task)
    out = list(grid[:nout])
    summed = prod(grid[nout:])
    if summed == 1:
        return tuple(out)
    extents = task.space.shape[:nout]
    splittable = set(splittable_dims(task))
    cut = [d for d in range(nout) if out[d] > 1]
    aligned = [d for d in range(cut[-1] if cut else 0, nout) if d in splittable]
    for d in aligned:
        if out[d] * summed <= extents[d]:
            out[d] *= summed
            return tuple(out)
    for d in aligned + [d for d in range(nout) if d in splittable and d not in aligned]:
        room = extents[d] // out[d]
        share = max(k for k in range(1, min(room, summed) + 1) if summed % k == 0)
        out[d] *= share
        summed //= share
    return tuple(out)


def piece_requirements(task: Task, grid: Grid) -> tuple[Requirement, ...]:
    """The requirements of `task`'s pieces on `grid`: its own, with every write a `reduce`
    when the grid cuts a reduction dim (each piece writes a partial sum)."""
    if not cuts_sum(task, grid):
        return task.requirements
    return as_partial_sums(task.requirements)


def as_partial_sums(requirements: Iterable[Requirement]) -> tuple[Requirement, ...]:
    """`requirements` of a piece that covers part of a dim its task sums over: its writes
    become reductions into the same rects."""
    return tuple(
        Requirement(r.tensor, r.role, Privilege.REDUCE, None, r.write_rect)
        if r.privilege is Privilege.WRITE
        else r
        for r in requirements
    )


SumTarget = tuple[int, np.ndarray, np.ndarray, np.ndarray]


def sum_targets(task: Task, grid: Grid) -> tuple[SumTarget, ...]:
    """(requirement index, ranks, lo, hi) of each partial sum's target: the cells of the sum
    grid over the written rect, cell i on rank i; empty unless `grid` cuts a reduction dim."""
    if not cuts_sum(task, grid):
        return ()
    out_grid = output_grid(task, grid)
    found = []
    for j, req in enumerate(task.requirements):
        if req.privilege is not Privilege.WRITE:
            continue
        ranks, lo, hi, _, _ = boxes.grid_cells(req.write_rect, out_grid)
        found.append((j, ranks, lo, hi))
    return tuple(found)
