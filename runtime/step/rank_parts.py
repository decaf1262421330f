"""Which ranks have a part in which tasks of a plan, read off its arrays.

A rank has a part in a task where it computes a piece of it, is an end of one of its transfers
(its gathers' copies too), takes part in one of its collectives, or holds a cell after it of
what it writes or adds into. A rank with no part in a task runs nothing of it, sends and
receives nothing, and holds none of its results, so its builder is told the task at once
(`rank_builder.Builder.idle`); of vgg19's model plan on 8192 ranks, 10% of the (task, rank)
pairs have a part. A rank with a part in no task and no home cell (beyond the widest layer of a
model-parallel plan: 4096 of those 8192) does nothing all step: a step simulated in shares
does not build it (`simulated_in_shares`), and it ends at 0.
"""

from __future__ import annotations

import numpy as np

from partitioner.plan import Plan


def has_part(plan: Plan) -> np.ndarray:
    """Per task of `plan`, per rank, whether the rank has a part in it; read-only, found once
    per plan."""
    return plan.derived("has_part", (), lambda: _has_part(plan))


def _has_part(plan: Plan) -> np.ndarray:
    found = np.zeros((len(plan.tasks), plan.nranks), bool)
    for row, task_plan in zip(found, plan.tasks):
        for piece_set in task_plan.piece_sets:
            row[piece_set.ranks] = True
        blocks = (*task_plan.transfer_set.blocks, *(b for b, _ in task_plan.gathered))
        for block in blocks:
            row[block.src] = True
            row[block.dsts] = True
        for collective in task_plan.collectives:
            row[list(collective.participants)] = True
        for layout in task_plan.holdings.values():
            row[layout.holder_ranks] = True
    found.flags.writeable = False
    return found


def idle_ranks(plan: Plan) -> np.ndarray:
    """The ranks of `plan` with a part in no task (`has_part`) that hold no cell of any home."""
    held = np.zeros(plan.nranks, bool)
    for layout in plan.homes.values():
        held[layout.holder_ranks] = True
    return np.flatnonzero(~(has_part(plan).any(axis=0) | held))
