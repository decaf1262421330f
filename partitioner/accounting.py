"""FLOPs and memory per rank of a plan.

FLOPs are counted per element of a task's iteration space, as its op's record states them by phase
(`legion_nn.op_records`; multiply and add count as two): a filter output reads C·R·S inputs, a `linear`
output C·H·W, elementwise ops a few, softmax and evaluate a few per class; `set_zero` and `data`
count none (memory traffic, a blind spot of the model). A homed piece is computed by every holder.

Memory traffic per rank (`bytes_per_rank`) is what the cost model's roofline term prices: the
bytes of every rect a rank's pieces of a task touch, once for a read or a write and twice for an
update in place (read-write, reduce). It counts each rect once, as if the kernel streamed it, so it
is a lower bound on a kernel's traffic (a filter re-reads its window from cache, not memory).

Memory per rank is everything the rank holds at any point of the step, with no reuse: its cells of
every tensor's layouts (activations, gradients, the homes of data, parameters, their gradients and
optimizer state, replicated or not; read from the plan's record of who holds what, `Plan.homes`
and `Plan.layouts`) plus the parts it receives for a read (once per tensor, rect
and rank over the step) and the partial sums it holds for a reduction into a rect it does not own,
plus the staging its messages need (`staged_bytes`, `reductions_memory`): a copy's send buffer
at its source, one per destination; a partial sum's receive buffer at its destination; and, for
each collective it joins, a buffer of the collective's whole vector (where its hops arrive, or
the vector it sums). It adds up by layer, which the search needs to price rows apart. It is not
the runtime's peak, which frees each buffer after its last use (`runtime.step.rank_memory`'s
placement, which `partition` reports and `auto` fits, `search/memory_fit.py`), but it is above
it on every rank of every plan tested (`tests/runtime/step/test_rank_memory.py`: every built-in
network under every built-in strategy and mixtures of them, sharded homes, pipeline stages):
what the count leaves out (a copy's receive buffer, live only until its reader runs; the
arena's alignment) is less than what the reuse saves. So what `auto`'s search counts as fitting
fits as placed.

Memory per layer splits that sum by table row (`memory_by_unit`), so the rows of a rank add up to
its total: a tensor's cells count in the row of the first task that touches it (an activation in
its producer's row; a parameter, its gradient and its optimizer state in the row of the layer that
reads it; an activation's gradient in the row whose backward first adds into it, i.e. of its
consumer; the loaded data in `data`), and received parts and partial sums in the row of the task
that receives or sends them. A row's max and mean are over ranks, so the rows' maxima need not add
up to the step's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from legion_nn import op_records
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.gathers import gather_memory
from partitioner.pieces import PieceSet
from partitioner.plan import Plan
from partitioner.task_plan import Reduction
from partitioner.transfers import TransferBlock


def flops_per_element(task: Task, graph: TaskGraph) -> float:
    """FLOPs per element of `task`'s space, from its op record (`legion_nn.op_records`)."""
    return op_records.flops_per_element(task, graph.tensors)


def flops_per_rank(graph: TaskGraph, plan: Plan) -> list[np.ndarray]:
    """FLOPs of every task (in `plan.tasks` order) on each of the plan's ranks."""
    return [
        pieces_flops(graph, task, task_plan.piece_sets, plan.nranks)
        for task, task_plan in zip(graph.tasks, plan.tasks)
    ]


def pieces_flops(
    graph: TaskGraph, task: Task, piece_sets: Iterable[PieceSet], nranks: int
) -> np.ndarray:
    """FLOPs of `task` on each of ranks 0..nranks-1 when it runs as `piece_sets`."""
    per = flops_per_element(task, graph)
    ranks = np.zeros(nranks)
    if per:
        for pieces in piece_sets:
            work = per * pieces.volumes().astype(float)
            ranks += np.bincount(
                pieces.ranks,
                weights=np.repeat(work, np.diff(pieces.rank_ptr)),
                minlength=nranks,
            )
    return ranks


def _passes(privilege: Privilege) -> int:
    return 2 if privilege in (Privilege.READ_WRITE, Privilege.REDUCE) else 1


def bytes_per_rank(graph: TaskGraph, plan: Plan) -> list[np.ndarray]:
    """Bytes each rank's pieces of every task (in `plan.tasks` order) read and write."""
    return [
        pieces_bytes(graph, task, task_plan.piece_sets, plan.nranks)
        for task, task_plan in zip(graph.tasks, plan.tasks)
    ]


def moves_bytes(task: Task) -> bool:
    """Whether the model prices a task's memory traffic: all but data loading, whose source (a
    host's dataset) is no tensor of the graph, and whose batch is small beside the step's work."""
    return task.op != "data"


def pieces_bytes(
    graph: TaskGraph, task: Task, piece_sets: Iterable[PieceSet], nranks: int
) -> np.ndarray:
    """Bytes `task`'s `piece_sets` read and write on each of ranks 0..nranks-1."""
    ranks = np.zeros(nranks)
    if not moves_bytes(task):
        return ranks
    for pieces in piece_sets:
        per_piece = np.zeros(len(pieces))
        for req, lo, hi in zip(pieces.requirements, pieces.req_lo, pieces.req_hi):
            weight = graph.tensors[req.tensor].itemsize * _passes(req.privilege)
            per_piece += boxes.volumes(lo, hi) * float(weight)
        ranks += np.bincount(
            pieces.ranks,
            weights=np.repeat(per_piece, np.diff(pieces.rank_ptr)),
            minlength=nranks,
        )
    return ranks


def task_flops(graph: TaskGraph, plan: Plan) -> dict[str, dict[int, float]]:
    """FLOPs of every task on every rank that computes part of it."""
    out: dict[str, dict[int, float]] = {}
    for task, task_plan, ranks in zip(graph.tasks, plan.tasks, flops_per_rank(graph, plan)):
        working = np.unique(np.concatenate([p.ranks for p in task_plan.piece_sets] or [[]]))
        working = working.astype(boxes.INDEX) if flops_per_element(task, graph) else working[:0]
        out[task.name] = dict(zip(working.tolist(), ranks[working].tolist()))
    return out


def memory_by_unit(graph: TaskGraph, plan: Plan, once: bool = True) -> dict[str, np.ndarray]:
    """Bytes each rank holds over the step, per table row (see the module docstring), kept on
    the plan for the graph.

    With `once` false a part received twice counts twice: a quicker upper bound."""
    return plan.derived(
        f"memory_by_unit_{once}", (graph,), lambda: _memory_by_unit(graph, plan, once)
    )


def _memory_by_unit(graph: TaskGraph, plan: Plan, once: bool) -> dict[str, np.ndarray]:
    n = plan.nranks
    rows: dict[str, np.ndarray] = {}
    owner: dict[str, str] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        rows.setdefault(task_plan.unit, np.zeros(n, boxes.INDEX))
        for req in task.requirements:
            owner.setdefault(req.tensor, task_plan.unit)

    def hold(name: str, layout) -> None:
        volume = layout.volume_per_rank(n) * graph.tensors[name].itemsize
        rows.setdefault(owner.get(name, "data"), np.zeros(n, boxes.INDEX))
        rows[owner.get(name, "data")] += volume

    layouts = plan.layouts
    for name, layout in layouts.items():
        hold(name, layout)
    for name, layout in plan.homes.items():
        if layouts.get(name) is not layout:
            hold(name, layout)
    received: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for task_plan in plan.tasks:
        for block in task_plan.transfer_set.blocks:
            if not len(block):
                continue
            rows[task_plan.unit] += staged_bytes(block, n)
            if block.reduce:
                rows[task_plan.unit] += _per_rank(block.src, block.nbytes, n)
            else:
                received[block.tensor].append((task_plan.unit, block))
        for block, gather in task_plan.gathered:  # the parts its copies would have brought
            received[block.tensor].append((task_plan.unit, block))
            rows[task_plan.unit] += gather_memory(gather, n)
        if task_plan.reductions:
            rows[task_plan.unit] += reductions_memory(task_plan.reductions, n)
    for found in received.values():
        if once:
            _count_copies(found, rows, n)
            continue
        for unit, block in found:
            rows[unit] += _per_rank(block.dsts, np.repeat(block.nbytes, block.fanout), n)
    return rows


#: vectors a collective's participant holds, counted whole: its partial sum (a scratch, or the
#: target itself where it owns it, which the layouts count), and the buffer its adding hops
#: receive into or the flat vector it sums (`runtime.step.buffers`: at most the vector)
COLLECTIVE_BUFFERS = 2


def staged_bytes(block: TransferBlock, n: int) -> np.ndarray:
    """Bytes each of ranks 0..n-1 stages for `block`'s messages: a copy's send buffer at its
    source, one per destination; a partial sum's receive buffer at its destination."""
    if block.reduce:
        return _per_rank(block.dsts, np.repeat(block.nbytes, block.fanout), n)
    return _per_rank(block.src, block.nbytes * block.fanout, n)


def reductions_memory(reductions: Iterable[Reduction], n: int) -> np.ndarray:
    """Bytes each of ranks 0..n-1 holds for `reductions` (`plan.Reduction`s): a participant
    holds the partial sum of every target it does not own, and a buffer of the collective's
    vector (`COLLECTIVE_BUFFERS`)."""
    # gathered as lists and added at once: a plan of 1024 ranks has thousands of collectives
    ranks: list[int] = []
    amounts: list[int] = []
    for reduction in reductions:
        ranks += reduction.participants
        amounts += [COLLECTIVE_BUFFERS * reduction.nbytes] * len(reduction.participants)
        for rect, holders in reduction.targets:
            ranks += holders
            amounts += [-rect.volume * reduction.itemsize] * len(holders)
    out = np.zeros(n, boxes.INDEX)
    np.add.at(out, np.array(ranks, boxes.INDEX), np.array(amounts, boxes.INDEX))
    return out


def _count_copies(found: list[tuple[str, object]], rows: dict[str, np.ndarray], n: int) -> None:
    """Add the parts of one tensor each rank receives, once per (rect, rank), to the row of the
    first task that brings them."""
    for (unit, _), held in zip(found, received_once([b for _, b in found], n)):
        rows[unit] += held


def received_once(blocks: list[TransferBlock], n: int) -> list[np.ndarray]:
    """Per block of transfers of one tensor (in plan order), the bytes each rank receives in it
    of parts (rect, rank) no earlier block brought."""
    lo = np.concatenate([b.lo for b in blocks])
    hi = np.concatenate([b.hi for b in blocks])
    ids, _ = boxes.first_seen_ids(np.concatenate((lo, hi), axis=1))
    fanout = np.concatenate([b.fanout for b in blocks])
    keys = np.repeat(ids, fanout) * n + np.concatenate([b.dsts for b in blocks])
    _, first = np.unique(keys, return_index=True)
    nbytes = np.repeat(np.concatenate([b.nbytes for b in blocks]), fanout)
    sizes = np.cumsum([0] + [int(b.dst_ptr[-1]) for b in blocks])
    which = np.searchsorted(sizes, first, side="right") - 1
    dsts = keys[first] % n
    out = []
    for k in range(len(blocks)):
        mine = which == k
        out.append(_per_rank(dsts[mine], nbytes[first[mine]], n))
    return out


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(ranks, weights=nbytes.astype(float), minlength=n).astype(boxes.INDEX)


def memory_per_rank(graph: TaskGraph, plan: Plan) -> dict[int, int]:
    """Bytes each rank holds over the step (see the module docstring)."""
    total = np.zeros(plan.nranks, boxes.INDEX)
    for row in memory_by_unit(graph, plan).values():
        total += row
    return dict(enumerate(total.tolist()))


def fits(graph: TaskGraph, plan: Plan, capacity: float) -> bool:
    """Whether every rank's memory (`memory_per_rank`) is within `capacity` bytes; the exact
    count is made only when the quick upper bound does not settle it."""
    for once in (False, True):
        total = np.zeros(plan.nranks, boxes.INDEX)
        for row in memory_by_unit(graph, plan, once).values():
            total += row
        if total.max(initial=0) <= capacity:
            return True
    return False
