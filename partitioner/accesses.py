"""What one partitioned task's pieces touch, tensor by tensor: the reads, writes and reductions
the planner's messages and holdings are made from (`plan.py`), and the search's replay's
(`layout_cache.py`).

The pieces' own privileges count: where a grid cuts a dim the task sums over, its pieces reduce
into the output (partial sums) and the task writes it where the sums land (`PieceSet.sums`,
`reduction_split.py`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.pieces import PieceSet

Columns = tuple[np.ndarray, ...]


@dataclass
class TaskAccesses:
    """What one partitioned task's pieces touch, by tensor: the (ranks, lo, hi, key) columns of
    its reads and reductions in order of each tensor's first access, and the (ranks, lo, hi) of
    its writes."""

    reads: list[tuple[str, Columns]]
    writes: dict[str, list[Columns]]
    reduces: list[tuple[str, Columns]]


def task_accesses(task: Task, pieces: PieceSet) -> TaskAccesses:
    """What the pieces touch, with their own privileges: where a grid cuts a reduction dim,
    the pieces reduce into the output (their partial sums) and the task writes it where the
    sums land (`PieceSet.sums`)."""
    nreq = len(task.requirements)
    key = np.arange(len(pieces), dtype=boxes.INDEX) * nreq
    owners = pieces.owners
    reads: dict[str, list[Columns]] = defaultdict(list)
    writes: dict[str, list[Columns]] = defaultdict(list)
    reduces: dict[str, list[Columns]] = defaultdict(list)
    for j, ranks, lo, hi in pieces.sums:
        writes[pieces.requirements[j].tensor].append((ranks, lo, hi))
    for j, req in enumerate(pieces.requirements):
        lo, hi = pieces.req_lo[j], pieces.req_hi[j]
        used = boxes.nonempty(lo, hi)
        if used.all():
            touched = (owners, lo, hi, key + j)
        else:
            touched = (owners[used], lo[used], hi[used], key[used] + j)
        if req.privilege.reads:
            reads[req.tensor].append(touched)
        if req.privilege is Privilege.REDUCE:
            reduces[req.tensor].append(touched)
        elif req.privilege.writes:
            writes[req.tensor].append((owners, lo, hi))
    return TaskAccesses(_by_first_key(reads), dict(writes), _by_first_key(reduces))


def _by_first_key(
    accesses: Mapping[str, list[tuple[np.ndarray, ...]]],
) -> list[tuple[str, tuple[np.ndarray, ...]]]:
    """(tensor, concatenated (ranks, lo, hi, key)) in order of each tensor's first access."""
    out = []
    for tensor, found in accesses.items():
        if len(found) == 1:
            columns = found[0]
        else:
            columns = tuple(np.concatenate(column) for column in zip(*found))
        if len(columns[0]):
            out.append((int(columns[3].min()), tensor, columns))
    return [(tensor, columns) for _, tensor, columns in sorted(out, key=lambda item: item[0])]
