"""What a task costs on a grid given its fetches and combines, each priced once per contents.

The search's replay (`transitions.py`) names a task's messages by keys. ("fetch", task, grid,
tensor, layout key, earlier reads, plain) is the task's read of `tensor` from the layout the key
names (`layout_cache.py`), after the earlier reads of it since it was written, (task, grid)
pairs: a rect a rank received once is not sent again (`messages.Copies`); `plain` says whether
the tensor was written outright and not added into since, where a read of all of it may arrive
by an all-gather (`partitioner.gathers`). ("combine", task, grid, tensor,
layout key) is the task's reduction into that layout. What a fetch or a combine moves is what
`transfers.link_loads`, `accounting.received_once` and the memory accounting make of the block
and the collectives `messages.fetch` and `combine` list: computed dim by dim where
`grid_loads.py` applies, by those functions where it does not. It is kept by its contents, the
layout's and the rects' digests, so the repeated layers of VGG share it; a task's seconds
(`cost.task_cost`) by its fetches and combines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from legion_nn.ir import Task
from partitioner import boxes
from partitioner.accounting import (
    COLLECTIVE_BUFFERS,
    pieces_bytes,
    pieces_flops,
    received_once,
    reductions_memory,
    staged_bytes,
)
from partitioner.collective_prices import collective_costs, reduction_cost
from partitioner.cost import busy_seconds, compute_time, task_cost
from partitioner.gathers import gather_memory, gather_of
from partitioner.grid_combine import Collectives, combine_loads
from partitioner.grid_loads import Moved, RectSet, fetch_loads
from partitioner.machine import Machine
from partitioner.messages import Accesses, combine, fetch
from partitioner.pieces import homed_pieces
from partitioner.plan import PlanError, reductions_of, task_rows
from partitioner.plan_memo import digest
from partitioner.search.layout_cache import Key, LayoutCache, Memo
from partitioner.strategy import Grid
from partitioner.task_plan import Reduction
from partitioner.transfers import TransferBlock, link_loads

Loads = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class _Moved:
    """What one fetch or combine of one task puts on the links."""

    loads: Loads | None  # (bytes sent, bytes received, message rounds) per rank; None: nothing
    wire: int  # bytes of its point-to-point transfers, counted per destination
    #: its collectives, in order, as `cost.busy_seconds` takes them: (groups of ranks, each
    #: one's group, each one's seconds); None: none
    collectives: tuple | None
    #: bytes held per rank for it: partial sums sent, staging, collective buffers
    memory: np.ndarray | None
    #: for a fetch that moves anything, the bytes of the parts each rank receives, each once
    received: np.ndarray | None


class TaskPrices:
    """Tasks' seconds and what their fetches and combines move (see the module docstring)."""

    def __init__(self, layouts: LayoutCache, machine: Machine) -> None:
        self.layouts, self.machine = layouts, machine
        self.graph, self.nranks = layouts.graph, layouts.nranks
        self.rows = task_rows(self.graph)
        self._memo = Memo()
        self._overlaps: dict = {}  # `grid_loads` per-dim overlaps
        #: use `grid_loads` where it applies (off: every message through `messages`)
        self.fast = True

    def _rects(self, key: Key, accesses: Accesses) -> RectSet:
        return self._memo.remember(("rects", key), lambda: RectSet(accesses))

    def _reduces(self, name: str, grid: Grid, tensor: str) -> tuple[Accesses, bytes]:
        def make():
            reduces = Accesses(*dict(self.layouts.accesses(name, grid).reduces)[tensor])
            return reduces, digest(reduces.rect_lo, reduces.rect_hi, reduces.ptr, reduces.ranks)

        return self._memo.remember(("reduces", name, grid, tensor), make)

    def _reads(self, name: str, grid: Grid, tensor: str) -> tuple[Accesses, bytes]:
        """The task's reads of `tensor` grouped by rect, and a digest of them."""

        def make():
            reads = Accesses(*dict(self.layouts.accesses(name, grid).reads)[tensor])
            return reads, digest(reads.rect_lo, reads.rect_hi, reads.ptr, reads.ranks)

        return self._memo.remember(("reads", name, grid, tensor), make)

    def _rows(self, name: str, grid: Grid, tensor: str) -> np.ndarray:
        """The (rect, rank) rows of the task's reads of `tensor`, as `Copies` records them."""

        def make():
            reads = self._reads(name, grid, tensor)[0]
            counts = np.diff(reads.ptr)
            rects = np.concatenate((reads.rect_lo, reads.rect_hi), axis=1)
            return np.concatenate((np.repeat(rects, counts, axis=0), reads.ranks[:, None]), axis=1)

        return self._memo.remember(("rows", name, grid, tensor), make)

    def _fresh(self, key: Key) -> tuple[Accesses, np.ndarray | None]:
        """A fetch's reads, and which of them are fresh (`messages.Copies`; None: all)."""

        def make():
            _, name, grid, tensor, _, before, _ = key
            reads, mine = self._reads(name, grid, tensor)
            if not before:
                return reads, None
            if any(self._reads(n, g, tensor)[1] == mine for n, g in before):
                return reads, np.zeros(len(reads.ranks), bool)  # the same reads again
            rows = self._rows(name, grid, tensor)
            held = np.concatenate([self._rows(n, g, tensor) for n, g in before])
            ids, _ = boxes.first_seen_ids(np.concatenate((held, rows)))
            fresh = ~np.isin(ids[len(held) :], ids[: len(held)])
            return reads, None if fresh.all() else fresh

        return self._memo.remember(("fresh", key), make)

    def _block(self, key: Key) -> TransferBlock:
        """The transfers of a fetch, as `messages.fetch` lists them."""

        def make() -> TransferBlock:
            _, name, _, tensor, layout_key, _, _ = key
            reads, fresh = self._fresh(key)
            fresh = np.ones(len(reads.ranks), bool) if fresh is None else fresh
            itemsize = self.graph.tensors[tensor].itemsize
            failure = _failure(self.graph.task(name))
            return fetch(tensor, itemsize, self.layouts.layout(layout_key), reads, fresh, failure)

        return self._memo.remember(("block", key), make)

    def _fetch(self, key: Key) -> _Moved:
        """What a fetch moves, kept by its contents: the same layout read the same way by
        another task (a repeated layer) is priced once."""
        _, name, grid, tensor, layout_key, _, plain = key
        reads, fresh = self._fresh(key)
        if fresh is not None and not fresh.any():
            return _NOTHING
        itemsize = self.graph.tensors[tensor].itemsize
        content = (
            "fetch",
            self.layouts.layout_digest(layout_key),
            self._reads(name, grid, tensor)[1],
            None if fresh is None else digest(fresh),
            itemsize,
            plain,
        )

        def make() -> _Moved:
            gather = None
            if plain:
                layout = self.layouts.layout(layout_key)
                gather = gather_of(tensor, itemsize, layout, reads, fresh)
            if gather is not None:
                return self._gathered(key, gather)
            fast = None
            if self.fast:
                geometry = self.layouts.geometry(layout_key)
                rects = self._rects(("reads", name, grid, tensor), reads)
                fast = fetch_loads(geometry, rects, fresh, itemsize, self.nranks, self._overlaps)
            if fast is not None:
                if fast.empty:
                    return _NOTHING
                return _Moved(_floats(fast), fast.wire, None, fast.staged, fast.held)
            block = self._block(key)
            if not len(block):
                return _NOTHING
            n = self.nranks
            loads = link_loads([block], n)
            received = received_once([block], n)[0]
            wire = int(np.dot(block.nbytes, block.fanout))
            return _Moved(loads, wire, None, staged_bytes(block, n), received)

        return self._memo.remember(content, make)

    def _gathered(self, key: Key, gather: Reduction) -> _Moved:
        """What a fetch that an all-gather brings moves (`partitioner.gathers`): the gather,
        and the parts its copies would have brought."""
        block = self._block(key)
        if not len(block):
            return _NOTHING
        n = self.nranks
        seconds, wire = reduction_cost(gather, self.machine)
        members = np.asarray(gather.participants, boxes.INDEX)
        collectives = ([members], np.zeros(1, np.int64), np.array([seconds]))
        return _Moved(
            None, wire, collectives, gather_memory(gather, n), received_once([block], n)[0]
        )

    def _combine(self, key: Key) -> _Moved:
        """What a combine moves, kept by its contents (see `_fetch`)."""
        _, name, grid, tensor, layout_key = key
        reduces, shape = self._reduces(name, grid, tensor)
        itemsize = self.graph.tensors[tensor].itemsize
        content = ("combine", self.layouts.layout_digest(layout_key), shape, itemsize)

        def make() -> _Moved:
            task = self.graph.task(name)
            layout = self.layouts.layout(layout_key)
            n, machine = self.nranks, self.machine
            fast = None
            if self.fast:
                rects = self._rects(("reduces", name, grid, tensor), reduces)
                fast = combine_loads(
                    self.layouts.geometry(layout_key), rects, itemsize, n, self._overlaps
                )
            collectives = None
            if fast is not None:
                moved, found = fast
                loads = None if moved.empty else _floats(moved)
                memory, wire = moved.held + moved.staged, moved.wire
                if len(found):
                    seconds, on_wire = collective_costs(
                        found.reduce,
                        found.contributors,
                        found.total,
                        found.largest,
                        machine,
                        found.handed_most,
                        found.handed_total,
                    )
                    collectives = (found.groups, found.group, seconds)
                    wire += int(on_wire.sum())
                    memory += _group_bytes(found, n)
                    memory -= np.bincount(found.holders, weights=found.nbytes, minlength=n).astype(
                        boxes.INDEX
                    )
            else:
                block, found = combine(tensor, itemsize, layout, reduces, 0, _failure(task))
                memory = np.zeros(n, boxes.INDEX)
                loads = None
                if len(block):
                    loads = link_loads([block], n)
                    memory += _per_rank(block.src, block.nbytes, n) + staged_bytes(block, n)
                wire = int(np.dot(block.nbytes, block.fanout))
                reductions = reductions_of(tensor, itemsize, found)
                if reductions:
                    groups, seconds = [], []
                    for reduction in reductions:
                        took, on_wire = reduction_cost(reduction, machine)
                        groups.append(np.asarray(reduction.participants, boxes.INDEX))
                        seconds.append(took)
                        wire += on_wire
                    memory += reductions_memory(reductions, n)
                    count = len(groups)
                    collectives = (groups, np.arange(count), np.array(seconds))
            if loads is None and collectives is None and not wire and not memory.any():
                return _NOTHING
            return _Moved(loads, wire, collectives, memory, None)

        return self._memo.remember(content, make)

    def task_cost(self, name: str, grid: Grid, keys: tuple[Key, ...]) -> tuple[float, object]:
        def make():
            task = self.graph.task(name)
            n = self.nranks
            pieces = self.layouts.pieces(name, grid)
            found = [(k, self._moved(k)) for k in keys]
            found = [(k, m) for k, m in found if m is not _NOTHING]  # keys stay with their loads
            traffic = self._traffic(task, [pieces])
            flops = self._flops(name, grid)
            if not found:  # it only computes
                return compute_time(task, flops, traffic, self.machine), None
            incoming = [np.zeros(n), np.zeros(n), np.zeros(n)]
            partial = [np.zeros(n), np.zeros(n), np.zeros(n)]
            groups: list[np.ndarray] = []
            named: dict[bytes, int] = {}
            group, seconds = [], []
            sent = 0
            memory = None
            for key, moved in found:
                if moved.loads is not None:
                    into = partial if key[0] == "combine" else incoming
                    for total, part in zip(into, moved.loads):
                        total += part
                if moved.collectives is not None:
                    mine, which, took = moved.collectives
                    ids = []
                    for members in mine:
                        ids.append(named.setdefault(members.tobytes(), len(groups)))
                        if ids[-1] == len(groups):
                            groups.append(members)
                    group.append(np.asarray(ids, np.int64)[which])
                    seconds.append(took)
                sent += moved.wire
                if moved.memory is not None:
                    memory = moved.memory if memory is None else memory + moved.memory
            busy = np.zeros(n)
            if group:
                busy = busy_seconds(groups, np.concatenate(group), np.concatenate(seconds), n)
            cost = task_cost(
                task, self.rows[name], flops, incoming, partial, busy, sent, self.machine, traffic
            )
            return cost.seconds, memory

        return self._memo.remember(("task", name, grid, keys), make)

    def _moved(self, key: Key) -> _Moved:
        """What a fetch, a combine or the least of several fetches moves."""
        if key[0] == "fetch":
            return self._fetch(key)
        if key[0] == "least":
            return self._least(key)
        return self._combine(key)

    def _least(self, key: Key) -> _Moved:
        """("least", fetch keys...): per rank, the least bytes sent, bytes received and message
        rounds over the fetches (a bound's read from a layout of one of several grids,
        `transitions.UnitPricer._least_fetch`); nothing where one of them moves nothing."""

        def make() -> _Moved:
            loads = []
            for fetch_key in key[1:]:
                moved = self._fetch(fetch_key)
                if moved.loads is None:
                    return _NOTHING
                loads.append(moved.loads)
            least = tuple(np.minimum.reduce([found[c] for found in loads]) for c in range(3))
            return _Moved(least, 0, None, None, None)

        return self._memo.remember(key, make)

    def _flops(self, name: str, grid: Grid) -> np.ndarray:
        """FLOPs per rank of task `name` on `grid`, kept: its cost is made once per set of
        messages, and most tasks meet several."""
        return self._memo.remember(
            ("flops", name, grid),
            lambda: pieces_flops(
                self.graph, self.graph.task(name), [self.layouts.pieces(name, grid)], self.nranks
            ),
        )

    def _traffic(self, task: Task, piece_sets) -> np.ndarray | None:
        """Bytes per rank of `piece_sets`, where the machine prices memory traffic."""
        if not self.machine.seconds_per_memory_byte:
            return None
        return pieces_bytes(self.graph, task, piece_sets, self.nranks)

    def homed_cost(self, name: str, home_keys: tuple[tuple[str, Key], ...]) -> float:
        """Seconds of homed task `name` given the homes it works on, (tensor, key) pairs."""
        task = self.graph.task(name)

        def make() -> float:
            homes = {t: self.layouts.layout(k) for t, k in home_keys}
            n = self.nranks
            pieces = homed_pieces(self.graph, task, homes)
            flops = pieces_flops(self.graph, task, pieces, n)
            zero = (np.zeros(n), np.zeros(n), np.zeros(n))
            cost = task_cost(
                task, self.rows[name], flops, zero, zero, zero[0], 0, self.machine,
                self._traffic(task, pieces),
            )  # fmt: skip
            return cost.seconds

        return self._memo.remember(("homed", name, home_keys), make)

    def received_bound(self, found: tuple[tuple[bool, Key], ...]) -> np.ndarray:
        """At least `received`: the parts the row's own fetches bring, each fetch's counted."""
        out = np.zeros(self.nranks, boxes.INDEX)
        for mine, key in found:
            got = self._fetch(key).received
            if mine and got is not None:
                out += got
        return out

    def received(self, found: tuple[tuple[bool, Key], ...]) -> np.ndarray:
        """Bytes per rank of the parts of one tensor that the row's fetches bring first."""

        def make() -> np.ndarray:
            out = np.zeros(self.nranks, boxes.INDEX)
            moved = [(mine, key) for mine, key in found if self._fetch(key).received is not None]
            if len(moved) == 1:  # each part reaches each rank once within a block
                mine, key = moved[0]
                if mine:
                    out += self._fetch(key).received
            elif moved:
                blocks = [self._block(key) for _, key in moved]
                for (mine, _), part in zip(moved, received_once(blocks, self.nranks)):
                    if mine:
                        out += part
            return out

        return self._memo.remember(("received", found), make)


_NOTHING = _Moved(None, 0, None, None, None)


def _group_bytes(found: Collectives, n: int) -> np.ndarray:
    """Bytes per rank its collectives hold: each participant the whole of each one's targets,
    `COLLECTIVE_BUFFERS` times."""
    sizes = np.array([len(g) for g in found.groups], boxes.INDEX)
    per_group = np.bincount(found.group, weights=found.total, minlength=len(found.groups))
    ranks = np.concatenate(found.groups)
    held = np.bincount(ranks, weights=np.repeat(per_group, sizes), minlength=n)
    held = held.astype(boxes.INDEX)
    return COLLECTIVE_BUFFERS * held


def _floats(moved: Moved) -> Loads:
    """`link_loads`'s arrays from a `grid_loads.Moved`."""
    return (
        moved.sent.astype(float),
        moved.received.astype(float),
        moved.rounds.astype(float),
    )


def _failure(task: Task):
    def fail(message: str) -> PlanError:
        return PlanError(f"task {task.name} {message}")

    return fail


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(ranks, weights=nbytes.astype(float), minlength=n).astype(boxes.INDEX)
