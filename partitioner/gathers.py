"""Whole-tensor reads as all-gathers: where every rank of a task reads all of a tensor that those
ranks hold in disjoint parts, written outright by one earlier task, the parts arrive by one
`allgather` collective rather than as copies from every owner to every reader.

A layer split by its outputs over p ranks (a `linear` under model parallelism, a convolution
cut by channels) leaves its output in p parts; the next such layer reads all of it on each of
its p ranks. As copies that is p(p − 1) messages, each posted and matched by MPI and each an
event of the simulated step: 4 million a layer on 2048 ranks, where a step could no longer be
simulated. As a collective it is the halving reduce-scatter's rounds run backwards
(`partitioner.collectives`): ⌈log2 p⌉ rounds (two more where p is not a power of two), about
p·log2 p hops, the same bytes, as MPI libraries run an all-gather of small parts (the ring
where the bytes outweigh the rounds, as the machine prices them).

The gather stands for the fetch it replaces (`TaskPlan.gathered` keeps that fetch's block):
each rank receives the same parts, so the copies kept (`messages.Copies`), the memory counted
and `verify_plan` read it as that fetch; only the delivery differs. The rank programs start it
where the copies would be posted, after the task that wrote the tensor, and complete it before
the next task that touches the tensor (`runtime.step.rank_program`). The planner
(`plan.build_plan`) and the search's replay (`search.task_prices`) both decide by `gather_of`,
so that the search prices what the plan runs.

Where it applies: at least `LEAST_PARTICIPANTS` readers (on two, the one exchange is the
copies'), each reading all of the layout's extent, none holding a copy yet, every part held by
one rank, and the tensor written outright by its last writer (not through partial sums, and
not added into since), so that its parts are final when the gather starts. A holder that does
not read (a classifier of 1000 outputs after a layer of 4096 on 2048 ranks) takes part only to
hand its parts to a reader first (`Reduction.core_places`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accesses import TaskAccesses
from partitioner.layout import Layout
from partitioner.messages import Accesses
from partitioner.pieces import PieceSet
from partitioner.task_plan import ALLGATHER, Reduction

#: the fewest readers whose whole-tensor reads are gathered
LEAST_PARTICIPANTS = 3


def plainly_writes(accesses: TaskAccesses, pieces: PieceSet, tensor: str) -> bool:
    """Whether a partitioned task's pieces write `tensor` outright: neither through partial
    sums (`PieceSet.sums`) nor adding into it."""
    return (
        tensor in accesses.writes
        and all(tensor != t for t, _ in accesses.reduces)
        and all(pieces.requirements[j].tensor != tensor for j, *_ in pieces.sums)
    )


class Adders:
    """Per tensor, the tasks that add into it, by their place in program order: whether a
    tensor written by one task is added into before another reads it (`outright`)."""

    def __init__(self, graph: TaskGraph) -> None:
        self.place = {task.name: i for i, task in enumerate(graph.tasks)}
        adding: dict[str, list[int]] = defaultdict(list)
        for i, task in enumerate(graph.tasks):
            for req in task.requirements:
                if req.privilege is Privilege.REDUCE:
                    adding[req.tensor].append(i)
        self._adding = {tensor: np.asarray(places) for tensor, places in adding.items()}

    def outright(
        self, tensor: str, writer: str, accesses: TaskAccesses, pieces: PieceSet, reader: str
    ) -> bool:
        """Whether `writer` (its pieces and their accesses on its grid) wrote `tensor` outright
        (`plainly_writes`) and no task adds into it before `reader`."""
        if not plainly_writes(accesses, pieces, tensor):
            return False
        places = self._adding.get(tensor)
        if places is None:
            return True
        first, last = self.place[writer], self.place[reader]
        return not ((places > first) & (places < last)).any()


class OutrightWrites:
    """While a plan is made task by task (`plan.build_plan`): per tensor, the partitioned task
    that wrote its layout now (its name, accesses, pieces and the layout), so that `outright`
    asks `Adders.outright` as the search's replay does."""

    def __init__(self, graph: TaskGraph) -> None:
        self.adders = Adders(graph)
        self._last: dict[str, tuple[str, TaskAccesses, PieceSet, Layout]] = {}

    def record(
        self, name: str, touched: TaskAccesses, pieces: PieceSet, after: Mapping[str, Layout]
    ) -> None:
        for tensor in touched.writes:
            self._last[tensor] = (name, touched, pieces, after[tensor])

    def forget(self, task: Task) -> None:
        """A homed task's writes: what it writes stays in its home."""
        for req in task.requirements:
            if req.privilege.writes:
                self._last.pop(req.tensor, None)

    def outright(self, tensor: str, layout: Layout, reader: str) -> bool:
        """Whether `layout` of `tensor` is what its last writer wrote outright, nothing adding
        into it before `reader`."""
        found = self._last.get(tensor)
        if found is None or found[3] is not layout:
            return False
        writer, touched, pieces, _ = found
        return self.adders.outright(tensor, writer, touched, pieces, reader)


def gather_of(
    tensor: str, itemsize: int, layout: Layout, reads: Accesses, fresh: np.ndarray | None
) -> Reduction | None:
    """The all-gather that brings a task's `reads` of `tensor` from `layout`, where one does
    (see the module docstring; the caller knows the tensor was written outright), else None.
    `fresh` marks the readers that hold no copy yet (None: all)."""
    if len(reads) != 1 or (fresh is not None and not fresh.all()):
        return None
    readers = np.unique(reads.ranks)
    if len(readers) < LEAST_PARTICIPANTS or not len(layout.holder_ranks):
        return None
    if not (layout.holder_count == 1).all():
        return None
    low = np.array([c[0] for c in layout.cut_arrays], boxes.INDEX)
    high = np.array([c[-1] for c in layout.cut_arrays], boxes.INDEX)
    if not ((reads.rect_lo[0] == low).all() and (reads.rect_hi[0] == high).all()):
        return None
    receivers = tuple(readers.tolist())
    participants = tuple(np.union1d(readers, layout.holder_ranks).tolist())
    shape = boxes.grid_shape(layout.cut_arrays)
    cells = np.unravel_index(np.arange(layout.ncells), shape)
    targets = tuple(
        (layout.cell_rect(coords), receivers) for coords in zip(*(c.tolist() for c in cells))
    )
    owners = tuple(layout.holder_ranks.tolist())
    return Reduction(tensor, ALLGATHER, participants, targets, itemsize, owners)


def gather_memory(gather: Reduction, nranks: int) -> np.ndarray:
    """Bytes each of ranks 0..nranks-1 holds for `gather` beyond the parts it receives: the
    collective's flat vector, on every participant (`runtime.rank_step`)."""
    out = np.zeros(nranks, boxes.INDEX)
    out[list(gather.participants)] = gather.nbytes
    return out
