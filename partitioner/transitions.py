"""A chain's cost unit by unit: one unit's table row under one (predecessor grid, grid) transition.

On a chain (`coupling.is_chain`) the tasks of a unit's row cost what they cost because of two
grids only, the unit's and its predecessor's, so `search.py` can find the best grid per unit by
dynamic programming over *transitions* (unit i, grid p of unit i − 1, grid q of unit i), given
the row's seconds under each. `UnitPricer.transition` prices one without planning the whole
step: it replays, in program order, the *window* of the row, which is

- the row's tasks (the unit's forward and backward tasks, the set_zero and update tasks that
  serve them), whose costs it adds up, and
- the tasks run on either unit's grid (or on a fixed grid) that write, read or reduce into a
  tensor the row reads or reduces into: the writes give the layouts the row's messages come
  from, the reads the copies a rank already holds (a rect received once is not sent again).

Every step of the replay is the planner's own (`plan.task_accesses`, `messages.fetch` and
`combine`, `plan.written_layout`, `plan.home_layout`, `cost.task_cost`,
`accounting.received_once`) or computes exactly what they would: a read of the very rect each
rank wrote moves nothing (the rects are compared, `_local`), and the loads, held bytes and
collectives of a fetch or a combine between grid layouts are computed dim by dim
(`grid_loads.py`, with the message-level functions as its fallback). Each result is kept under a
key naming what it depends on: a task's pieces by (task, grid); a layout by the task and grid
that wrote it, or, for a home, by its readers' grids; a fetch or a combine by its contents (the
layout's and the rects' digests, so the repeated layers of VGG share them); a task's cost by its
fetches and combines. So a row's seconds under a transition are, float for float, what
`plan_cost` gives the row of any whole plan with those two grids
(`tests/test_partition_search.py` checks this on random chains and rank counts), and the work a
transition shares with others (everything of the row that does not depend on the predecessor's
grid) is done once.

`UnitPricer.bound(i, q)` replays the row on grid q with the predecessor's tasks left out: the
messages and collectives whose layouts or copies come from the predecessor's grid are dropped,
tasks on that grid count 0. What is kept is priced as in `transition`, and a task's seconds only
grow with the messages it moves, so the bound is below the row's seconds after any predecessor.

Memory. A plan's memory per rank (`accounting.memory_by_unit`) is a sum of terms, and on a chain
each term is set by one transition: a tensor's final layout by the unit whose grid its last
writer runs on; a home (data, a parameter with its gradient and optimizer state) by the later
of the two units reading it; the parts a task receives (once per rank and part over the step),
the partial sums it sends and the buffers of its collectives by its row. `transition` returns
the terms it sets and `constant` the terms no unit sets (tensors on fixed grids), so the
memory of any assignment of grids is their sum, exactly `memory_per_rank` of its whole plan.

The replay leaves out one coupling, the one `coupling.py` leaves out: a task of a third unit
reading a tensor of the row (the next unit's forward reading this unit's output) could give a
rank a copy that a later read of the row then finds. A graph where a task outside the two units
*writes* what the row reads, or where a parameter has readers beyond two consecutive units, is
not priced this way (`NotAChain`); `search.py` then runs its local search over whole plans.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accounting import (
    flops_per_element,
    moves_bytes,
    pieces_bytes,
    pieces_flops,
    received_once,
    reductions_memory,
)
from partitioner.cost import (
    busy_seconds,
    collective_costs,
    compute_time,
    reduction_cost,
    task_cost,
)
from partitioner.grid_loads import (
    Collectives,
    Geometry,
    Moved,
    RectSet,
    combine_loads,
    fetch_loads,
)
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.messages import Accesses, combine, fetch
from partitioner.pieces import PieceCache, PieceSet, homed_pieces
from partitioner.plan import (
    PlanError,
    TaskAccesses,
    home_layout,
    reductions_of,
    resident_reads,
    task_accesses,
    task_rows,
    written_layout,
)
from partitioner.strategy import Grid, Unit, backward_grid, is_homed, param_of
from partitioner.transfers import TransferBlock, link_loads

Loads = tuple[np.ndarray, np.ndarray, np.ndarray]
Key = tuple


class NotAChain(Exception):
    """The graph's costs do not split into transitions between consecutive units."""


@dataclass
class _Moved:
    """What one fetch or combine of one task puts on the links."""

    loads: Loads | None  # (bytes sent, bytes received, message rounds) per rank; None: nothing
    wire: int  # bytes of its point-to-point transfers, counted per destination
    #: its collectives, in order, as `cost.busy_seconds` takes them: (groups of ranks, each
    #: one's group, each one's extra rank or -1, each one's seconds); None: none
    collectives: tuple | None
    #: bytes held per rank for it: partial sums sent, collective buffers
    memory: np.ndarray | None
    #: for a fetch that moves anything, the bytes of the parts each rank receives, each once
    received: np.ndarray | None


@dataclass(frozen=True)
class RowCost:
    """One unit's row under one transition."""

    seconds: float
    #: bytes per rank of the memory terms this transition sets (see the module docstring)
    memory: np.ndarray


class UnitPricer:
    """Prices the rows of a chain's units under transitions (see the module docstring)."""

    def __init__(
        self,
        graph: TaskGraph,
        units: Sequence[Unit],
        nranks: int,
        machine: Machine,
        cache: PieceCache | None = None,
    ) -> None:
        self.graph, self.units, self.nranks, self.machine = graph, list(units), nranks, machine
        self.cache = cache or PieceCache(graph)
        self.rows = task_rows(graph)
        self.homed = {t.name for t in graph.tasks if is_homed(graph, t)}
        self._grids: dict[tuple, Grid] = {}
        self._overlaps: dict = {}  # `grid_loads` per-dim overlaps
        self._rules()
        self._homes()
        self._windows()
        self._memory_terms()
        self._memo: dict[Key, object] = {}
        self.priced = 0
        #: use `grid_loads` where it applies (off: every message through `messages`)
        self.fast = True

    # -- static analysis -------------------------------------------------------------------

    def _rules(self) -> None:
        """How each partitioned task's grid follows from a unit's (`strategy.task_grids`)."""
        graph = self.graph
        self.unit_of: dict[str, int | None] = {}
        self.rule: dict[str, tuple] = {}
        for index, unit in enumerate(self.units):
            for name in unit.forward:
                self.unit_of[name], self.rule[name] = index, ("unit",)
            for name in unit.backward:
                self.unit_of[name] = index
                self.rule[name] = ("backward", name[: -len(".grad")])
        producer: dict[str, str] = {}
        reader: dict[str, str] = {}
        for task in graph.tasks:
            if task.name not in self.rule:
                continue
            for req in task.requirements:
                if req.write_rect is not None:
                    producer.setdefault(req.tensor, task.name)
                if req.read_rect is not None and not req.read_rect.is_empty():
                    reader.setdefault(req.tensor, task.name)
        for task in graph.tasks:
            if task.name in self.rule or task.name in self.homed:
                continue
            target = graph.tensors[task.requirements[0].tensor]
            base = target.name.removesuffix(".grad")
            source = producer.get(base) or reader.get(base)
            if task.op == "set_zero" and source is not None and target.kind == "grad":
                self.unit_of[task.name] = self.unit_of[source]
                self.rule[task.name] = ("aligned", source)
            else:
                self.unit_of[task.name] = None
                self.rule[task.name] = ("fixed",)

    def grid(self, name: str, grids: Mapping[int, Grid]) -> Grid:
        """The grid of partitioned task `name` when unit k runs on `grids[k]`."""
        unit = self.unit_of[name]
        key = (name, None if unit is None else grids.get(unit))
        found = self._grids.get(key)
        if found is None:
            found = self._grids[key] = self._grid(name, grids)
        return found

    def _grid(self, name: str, grids: Mapping[int, Grid]) -> Grid:
        rule = self.rule[name]
        task = self.graph.task(name)
        if rule[0] == "fixed":
            return (1,) * task.space.ndim
        unit = self.unit_of[name]
        if unit not in grids:
            raise NotAChain(f"task {name} runs on the grid of unit {self.units[unit].name}")
        if rule[0] == "unit":
            return grids[unit]
        if rule[0] == "backward":
            return backward_grid(self.graph.task(rule[1]), task, grids[unit])
        source = self.graph.task(rule[1])
        grid = self.grid(rule[1], grids)
        shape = source.space.shape
        return tuple(
            grid[d] if d < len(shape) and shape[d] == extent else 1
            for d, extent in enumerate(task.space.shape)
        )

    def _homes(self) -> None:
        """Which tensors live in a home, whose readers make it, and the units of those."""
        graph = self.graph
        self.home_source: dict[str, str] = {}
        for name, tensor in graph.tensors.items():
            if tensor.kind in ("data", "param"):
                self.home_source[name] = name
        for name in graph.tensors:
            owner = param_of(graph, name)
            if owner is not None and name not in self.home_source:
                self.home_source[name] = owner
        self.readers: dict[str, list[str]] = defaultdict(list)
        for task in graph.tasks:
            if task.name in self.homed:
                continue
            for tensor in dict.fromkeys(
                r.tensor
                for r in task.requirements
                if r.privilege.reads and graph.tensors[r.tensor].resident
            ):
                self.readers[tensor].append(task.name)

    def _home_units(self, source: str) -> int | None:
        """The unit whose transition sets the home of `source` (None: no unit's grid does)."""
        found = {self.unit_of[r] for r in self.readers.get(source, [])} - {None}
        if not found:
            return None
        last = max(found)
        if not found <= {last - 1, last}:
            raise NotAChain(f"{source} is read by units that are not consecutive")
        return last

    def _windows(self) -> None:
        graph = self.graph
        index = {unit.name: i for i, unit in enumerate(self.units)}
        self.constant_tasks = [t.name for t in graph.tasks if self.rows[t.name] not in index]
        self.window: list[list[str]] = []
        self.costed: list[set[str]] = []
        self.touched: list[set[str]] = []
        for i, unit in enumerate(self.units):
            costed = {t.name for t in graph.tasks if self.rows[t.name] == unit.name}
            self.window.append(self._window(costed, {i - 1, i, None}))
            self.costed.append(costed)
            self.touched.append(set(self._touched(costed)))
        self.constant_window = self._window(set(self.constant_tasks), {None})
        self.constant_touched = set(self._touched(set(self.constant_tasks)))

    def _touched(self, costed: set[str]) -> dict[str, int]:
        """The tensors the non-homed tasks in `costed` read or reduce into, each with the
        position of its last such access."""
        touched: dict[str, int] = {}
        for position, task in enumerate(self.graph.tasks):
            if task.name in costed and task.name not in self.homed:
                for req in task.requirements:
                    if req.privilege.reads or req.privilege is Privilege.REDUCE:
                        touched[req.tensor] = position
        return touched

    def _window(self, costed: set[str], allowed: set[int | None]) -> list[str]:
        graph = self.graph
        touched = self._touched(costed)
        window = []
        for position, task in enumerate(graph.tasks):
            if task.name in costed:
                if task.name not in self.homed and self.unit_of[task.name] not in allowed:
                    raise NotAChain(f"task {task.name} runs on the grid of another unit")
                window.append(task.name)
                continue
            if task.name in self.homed:
                continue
            mine = [r for r in task.requirements if r.tensor in touched]
            if not mine:
                continue
            if self.unit_of[task.name] in allowed:
                window.append(task.name)
            elif any(
                r.privilege.writes
                and r.privilege is not Privilege.REDUCE
                and touched[r.tensor] > position
                for r in mine
            ):
                raise NotAChain(f"task {task.name} writes what another unit's row reads")
        return window

    def _memory_terms(self) -> None:
        """Which unit's transition sets each tensor's layouts (None: no unit's)."""
        graph = self.graph
        last_writer: dict[str, str] = {}
        for task in graph.tasks:
            if task.name in self.homed:
                continue
            for req in task.requirements:
                if req.privilege.writes and req.privilege is not Privilege.REDUCE:
                    last_writer[req.tensor] = task.name
        self.write_terms: dict[int | None, list[tuple[str, str]]] = defaultdict(list)
        self.home_terms: dict[int | None, list[str]] = defaultdict(list)
        for name in graph.tensors:
            if name in last_writer:
                writer = last_writer[name]
                self.write_terms[self.unit_of[writer]].append((name, writer))
            if name in self.home_source:
                self.home_terms[self._home_units(self.home_source[name])].append(name)

    # -- memoised steps --------------------------------------------------------------------

    def _remember(self, key: Key, make):
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = make()
        return found

    def _pieces(self, name: str, grid: Grid) -> PieceSet:
        return self.cache.get(self.graph, self.graph.task(name), grid)

    def _accesses(self, name: str, grid: Grid) -> TaskAccesses:
        return self._remember(
            ("accesses", name, grid),
            lambda: task_accesses(self.graph.task(name), self._pieces(name, grid)),
        )

    def _home_key(self, tensor: str, grids: Mapping[int, Grid]) -> Key:
        source = self.home_source[tensor]
        readers = tuple((r, self.grid(r, grids)) for r in self.readers.get(source, []))
        return ("home", source, readers)

    def _layout(self, key: Key) -> Layout:
        """The layout `key` names, made once per contents: different grids often leave a
        tensor the same (a replicated parameter's home), and repeated layers write alike."""

        def make() -> Layout:
            if key[0] == "home":
                return home_layout(self.graph, key[1], self._home_reads(key))
            _, name, grid, tensor = key
            found = self._accesses(name, grid).writes[tensor]
            return written_layout(self.graph, self.graph.task(name), tensor, found)

        return self._remember(
            ("layout", key),
            lambda: self._remember(("layout of", key[0], self._layout_digest(key)), make),
        )

    def _layout_digest(self, key: Key) -> bytes:
        """A digest naming the layout's contents: of the rects and ranks it is made from."""

        def make() -> bytes:
            if key[0] == "write":
                _, name, grid, tensor = key
                found = self._accesses(name, grid).writes[tensor]
                return digest(*(a for columns in found for a in columns))
            found = self._home_reads(key)
            if not found:
                return digest(np.asarray(self.graph.tensors[key[1]].dims))
            return digest(*(a for columns in found for a in columns))

        return self._remember(("layout digest", key), make)

    def _geometry(self, key: Key) -> Geometry:
        """`grid_loads.Geometry` of the layout `key` names, made once per contents."""
        return self._remember(
            ("geometry", key),
            lambda: self._remember(
                ("geometry of", key[0], self._layout_digest(key)),
                lambda: Geometry(self._layout(key), self.nranks),
            ),
        )

    def _rects(self, key: Key, accesses: Accesses) -> RectSet:
        return self._remember(("rects", key), lambda: RectSet(accesses))

    def _reduces(self, name: str, grid: Grid, tensor: str) -> tuple[Accesses, bytes]:
        def make():
            reduces = Accesses(*dict(self._accesses(name, grid).reduces)[tensor])
            return reduces, digest(reduces.rect_lo, reduces.rect_hi, reduces.ptr, reduces.ranks)

        return self._remember(("reduces", name, grid, tensor), make)

    def _reads(self, name: str, grid: Grid, tensor: str) -> tuple[Accesses, bytes]:
        """The task's reads of `tensor` grouped by rect, and a digest of them."""

        def make():
            reads = Accesses(*dict(self._accesses(name, grid).reads)[tensor])
            return reads, digest(reads.rect_lo, reads.rect_hi, reads.ptr, reads.ranks)

        return self._remember(("reads", name, grid, tensor), make)

    def _rows(self, name: str, grid: Grid, tensor: str) -> np.ndarray:
        """The (rect, rank) rows of the task's reads of `tensor`, as `Copies` records them."""

        def make():
            reads = self._reads(name, grid, tensor)[0]
            counts = np.diff(reads.ptr)
            rects = np.concatenate((reads.rect_lo, reads.rect_hi), axis=1)
            return np.concatenate((np.repeat(rects, counts, axis=0), reads.ranks[:, None]), axis=1)

        return self._remember(("rows", name, grid, tensor), make)

    def _fresh(self, key: Key) -> tuple[Accesses, np.ndarray | None]:
        """A fetch's reads, and which of them are fresh (`messages.Copies`; None: all)."""

        def make():
            _, name, grid, tensor, _, before = key
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

        return self._remember(("fresh", key), make)

    def _block(self, key: Key) -> TransferBlock:
        """The transfers of a fetch, as `messages.fetch` lists them."""

        def make() -> TransferBlock:
            _, name, _, tensor, layout_key, _ = key
            reads, fresh = self._fresh(key)
            fresh = np.ones(len(reads.ranks), bool) if fresh is None else fresh
            itemsize = self.graph.tensors[tensor].itemsize
            failure = _failure(self.graph.task(name))
            return fetch(tensor, itemsize, self._layout(layout_key), reads, fresh, failure)

        return self._remember(("block", key), make)

    def _fetch(self, key: Key) -> _Moved:
        """What a fetch moves, kept by its contents: the same layout read the same way by
        another task (a repeated layer) is priced once."""
        _, name, grid, tensor, layout_key, _ = key
        reads, fresh = self._fresh(key)
        if fresh is not None and not fresh.any():
            return _NOTHING
        itemsize = self.graph.tensors[tensor].itemsize
        content = (
            "fetch",
            self._layout_digest(layout_key),
            self._reads(name, grid, tensor)[1],
            None if fresh is None else digest(fresh),
            itemsize,
        )

        def make() -> _Moved:
            fast = None
            if self.fast:
                geometry = self._geometry(layout_key)
                rects = self._rects(("reads", name, grid, tensor), reads)
                fast = fetch_loads(geometry, rects, fresh, itemsize, self.nranks, self._overlaps)
            if fast is not None:
                if fast.empty:
                    return _NOTHING
                return _Moved(_floats(fast), fast.wire, None, None, fast.held)
            block = self._block(key)
            if not len(block):
                return _NOTHING
            loads = link_loads([block], self.nranks)
            received = received_once([block], self.nranks)[0]
            return _Moved(loads, int(np.dot(block.nbytes, block.fanout)), None, None, received)

        return self._remember(content, make)

    def _combine(self, key: Key) -> _Moved:
        """What a combine moves, kept by its contents (see `_fetch`)."""
        _, name, grid, tensor, layout_key = key
        reduces, shape = self._reduces(name, grid, tensor)
        itemsize = self.graph.tensors[tensor].itemsize
        content = ("combine", self._layout_digest(layout_key), shape, itemsize)

        def make() -> _Moved:
            task = self.graph.task(name)
            layout = self._layout(layout_key)
            n, machine = self.nranks, self.machine
            fast = None
            if self.fast:
                rects = self._rects(("reduces", name, grid, tensor), reduces)
                fast = combine_loads(self._geometry(layout_key), rects, itemsize, n, self._overlaps)
            collectives = None
            if fast is not None:
                moved, found = fast
                loads = None if moved.empty else _floats(moved)
                memory, wire = moved.held.copy(), moved.wire
                if len(found):
                    seconds, on_wire = collective_costs(
                        found.reduce, found.sizes(), found.total, found.largest, machine
                    )
                    collectives = (found.groups, found.group, found.extra, seconds)
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
                    memory += _per_rank(block.src, block.nbytes, n)
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
                    collectives = (
                        groups,
                        np.arange(count),
                        np.full(count, -1),
                        np.array(seconds),
                    )
            if loads is None and collectives is None and not wire and not memory.any():
                return _NOTHING
            return _Moved(loads, wire, collectives, memory, None)

        return self._remember(content, make)

    def _task_cost(self, name: str, grid: Grid, keys: tuple[Key, ...]) -> tuple[float, object]:
        def make():
            task = self.graph.task(name)
            n = self.nranks
            pieces = self._pieces(name, grid)
            moved = [self._fetch(k) if k[0] == "fetch" else self._combine(k) for k in keys]
            moved = [m for m in moved if m is not _NOTHING]
            traffic = self._traffic(task, [pieces])
            flops = self._flops(name, grid)
            if not moved:  # it only computes
                return compute_time(task, flops, traffic, self.machine), None
            incoming = [np.zeros(n), np.zeros(n), np.zeros(n)]
            partial = [np.zeros(n), np.zeros(n), np.zeros(n)]
            groups: list[np.ndarray] = []
            named: dict[bytes, int] = {}
            group, extra, seconds = [], [], []
            sent = 0
            memory = None
            for key, found in zip(keys, moved):
                if found.loads is not None:
                    into = incoming if key[0] == "fetch" else partial
                    for total, part in zip(into, found.loads):
                        total += part
                if found.collectives is not None:
                    mine, which, alone, took = found.collectives
                    ids = []
                    for members in mine:
                        ids.append(named.setdefault(members.tobytes(), len(groups)))
                        if ids[-1] == len(groups):
                            groups.append(members)
                    group.append(np.asarray(ids, np.int64)[which])
                    extra.append(alone)
                    seconds.append(took)
                sent += found.wire
                if found.memory is not None:
                    memory = found.memory if memory is None else memory + found.memory
            busy = np.zeros(n)
            if group:
                busy = busy_seconds(
                    groups, np.concatenate(group), np.concatenate(extra), np.concatenate(seconds), n
                )
            cost = task_cost(
                task, self.rows[name], flops, incoming, partial, busy, sent, self.machine, traffic
            )
            return cost.seconds, memory

        return self._remember(("task", name, grid, keys), make)

    def _flops(self, name: str, grid: Grid) -> np.ndarray:
        """FLOPs per rank of task `name` on `grid`, kept: its cost is made once per set of
        messages, and most tasks meet several."""
        return self._remember(
            ("flops", name, grid),
            lambda: pieces_flops(
                self.graph, self.graph.task(name), [self._pieces(name, grid)], self.nranks
            ),
        )

    def _traffic(self, task: Task, piece_sets) -> np.ndarray | None:
        """Bytes per rank of `piece_sets`, where the machine prices memory traffic."""
        if not self.machine.seconds_per_memory_byte:
            return None
        return pieces_bytes(self.graph, task, piece_sets, self.nranks)

    def _homed_cost(self, name: str, grids: Mapping[int, Grid]) -> float:
        task = self.graph.task(name)
        tensors = [r.tensor for r in task.requirements] if task.op == "data" else []
        tensors = tensors or [task.requirements[0].tensor]
        keys = tuple(self._home_key(t, grids) for t in tensors)

        def make() -> float:
            homes = {t: self._layout(k) for t, k in zip(tensors, keys)}
            n = self.nranks
            pieces = homed_pieces(self.graph, task, homes)
            flops = pieces_flops(self.graph, task, pieces, n)
            zero = (np.zeros(n), np.zeros(n), np.zeros(n))
            cost = task_cost(
                task, self.rows[name], flops, zero, zero, zero[0], 0, self.machine,
                self._traffic(task, pieces),
            )  # fmt: skip
            return cost.seconds

        return self._remember(("homed", name, keys), make)

    # -- replay ----------------------------------------------------------------------------

    def transition(self, i: int, p: Grid | None, q: Grid) -> RowCost:
        """Unit i's row on grid `q` after unit i − 1 on grid `p` (None for the first unit)."""
        grids = {i: q} if p is None else {i - 1: p, i: q}
        self.priced += 1
        return self._replay(self.window[i], self.costed[i], self.touched[i], grids, i)

    def bound(self, i: int, q: Grid) -> float:
        """A lower bound on unit i's row seconds on grid `q` whatever the grid of unit i − 1:
        the row's tasks without the messages and collectives whose layouts or copies come from
        the predecessor's grid (a task's seconds only grow with what it moves), tasks run on the
        predecessor's grid counted as 0. What it keeps is priced exactly as in `transition`."""
        return self._remember(("bound", i, q), lambda: self._bound(i, q))

    def _bound(self, i: int, q: Grid) -> float:
        seconds, _ = self._walk(self.window[i], self.costed[i], self.touched[i], {i: q}, i, i - 1)
        return seconds

    def constant(self) -> RowCost:
        """The rows of no unit (data loading) and the memory no unit's grid sets."""
        return self._replay(
            self.constant_window, set(self.constant_tasks), self.constant_touched, {}, None
        )

    def _replay(
        self,
        window: list[str],
        costed: set[str],
        touched: set[str],
        grids: Mapping[int, Grid],
        unit: int | None,
    ) -> RowCost:
        seconds, memory = self._walk(window, costed, touched, grids, unit, None)
        return RowCost(seconds, memory)

    def _walk(
        self,
        window: list[str],
        costed: set[str],
        touched: set[str],
        grids: Mapping[int, Grid],
        unit: int | None,
        hidden: int | None,
    ) -> tuple[float, np.ndarray | None]:
        """The seconds of the `costed` tasks of `window`, replayed in program order, and the
        memory terms `unit`'s transition sets.

        `hidden` is the unit whose grid is unknown, for `bound` (None: `transition`, every grid
        known): its tasks are left out, the tensors they write have unknown layouts and those
        they read unknown copies, and the messages and collectives that would need either are
        dropped; a home read on its grid is unknown too. No memory is counted then."""
        bounding = hidden is not None
        layouts: dict[str, Key] = {}
        copies: dict[str, tuple[tuple[str, Grid], ...]] = {}
        fetched: dict[str, list[tuple[bool, Key]]] = defaultdict(list)
        tainted: set[str] = set()  # read on the hidden grid since last written
        seconds = 0.0
        memory = None if bounding else self._tensor_memory(unit, grids)
        for name in window:
            if name in self.homed:
                seconds += self._homed_seconds(name, grids, bounding)
                continue
            if bounding and self.unit_of[name] == hidden:
                for req in self.graph.task(name).requirements:
                    if req.privilege.reads:
                        tainted.add(req.tensor)
                    elif req.privilege.writes and req.privilege is not Privilege.REDUCE:
                        layouts[req.tensor] = _UNKNOWN
                continue
            grid = self.grid(name, grids)
            accesses = self._accesses(name, grid)
            mine = name in costed
            keys: list[Key] = []
            for tensor, _ in accesses.reads:
                if not mine and tensor not in touched:
                    continue
                layout_key = layouts.get(tensor)
                if layout_key is None:
                    if self.home_source.get(tensor) == tensor:
                        continue  # a rank's home holds what it reads
                    layout_key = layouts[tensor] = self._first_layout(
                        name, tensor, grids, bounding, reduce=False
                    )
                before = copies.get(tensor, ())
                copies[tensor] = before + ((name, grid),)
                if layout_key is _UNKNOWN or tensor in tainted or (bounding and not mine):
                    continue
                if self._local(name, grid, tensor, layout_key, reduce=False):
                    continue  # each rank reads what it wrote: nothing moves
                key = ("fetch", name, grid, tensor, layout_key, before)
                if not bounding:
                    fetched[tensor].append((mine, key))
                if mine:
                    keys.append(key)
            for tensor in accesses.writes:
                layouts[tensor] = ("write", name, grid, tensor)
                copies[tensor] = ()
                tainted.discard(tensor)
            if not mine:
                continue
            for tensor, _ in accesses.reduces:
                layout_key = layouts.get(tensor)
                if layout_key is None:
                    layout_key = layouts[tensor] = self._first_layout(
                        name, tensor, grids, bounding, reduce=True
                    )
                if layout_key is _UNKNOWN:
                    continue
                if not self._local(name, grid, tensor, layout_key, reduce=True):
                    keys.append(("combine", name, grid, tensor, layout_key))
            task_seconds, held = self._task_cost(name, grid, tuple(keys))
            seconds += task_seconds
            if memory is not None and held is not None:
                memory = memory + held
        if memory is not None:
            for found in fetched.values():
                if any(mine for mine, _ in found):
                    memory = memory + self._received(tuple(found))
        return seconds, memory

    def _first_layout(
        self, name: str, tensor: str, grids: Mapping[int, Grid], bounding: bool, reduce: bool
    ) -> Key:
        """The layout of a tensor that task `name` touches before the window writes it: its
        home (for a bound, unknown where the home is read on the hidden grid, or has none)."""
        if bounding:
            try:
                return self._home_key(tensor, grids)
            except (KeyError, NotAChain):
                return _UNKNOWN
        if tensor not in self.home_source:
            if reduce:
                raise PlanError(f"task {name} reduces into {tensor}, which was never zeroed")
            raise PlanError(f"task {name} reads {tensor}, which no earlier task wrote")
        return self._home_key(tensor, grids)

    def _homed_seconds(self, name: str, grids: Mapping[int, Grid], bounding: bool) -> float:
        task = self.graph.task(name)
        if bounding:  # only what it computes counts, and not where its home is unknown
            if not flops_per_element(task, self.graph):
                return 0.0
            try:
                return self._homed_cost(name, grids)
            except NotAChain:
                return 0.0  # its home is read on the hidden grid
        if flops_per_element(task, self.graph) or (
            self.machine.seconds_per_memory_byte and moves_bytes(task)
        ):
            return self._homed_cost(name, grids)
        return self.machine.task_overhead  # no FLOPs and no bytes: `compute_time`'s overhead

    def _local(self, name: str, grid: Grid, tensor: str, layout_key: Key, reduce: bool) -> bool:
        """Whether every rank of the task reads (or reduces into) exactly the rect of `tensor`
        it wrote itself, so that nothing moves: the rects are compared, not the messages."""
        if layout_key[0] != "write":
            return False
        _, writer, written, _ = layout_key

        def make() -> bool:
            mine, theirs = self._pieces(name, grid), self._pieces(writer, written)
            task, source = self.graph.task(name), self.graph.task(writer)
            wrote = [
                k
                for k, r in enumerate(source.requirements)
                if r.tensor == tensor and r.privilege.writes and r.privilege is not Privilege.REDUCE
            ]
            touch = [
                j
                for j, r in enumerate(task.requirements)
                if r.tensor == tensor
                and (r.privilege is Privilege.REDUCE if reduce else r.privilege.reads)
            ]
            if len(wrote) != 1 or not np.array_equal(mine.owners, theirs.owners):
                return False
            k = wrote[0]
            return all(
                np.array_equal(mine.req_lo[j], theirs.req_lo[k])
                and np.array_equal(mine.req_hi[j], theirs.req_hi[k])
                for j in touch
            )

        return self._remember(("local", name, grid, tensor, writer, written, reduce), make)

    def _received(self, found: tuple[tuple[bool, Key], ...]) -> np.ndarray:
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

        return self._remember(("received", found), make)

    def _tensor_memory(self, unit: int | None, grids: Mapping[int, Grid]) -> np.ndarray:
        """Bytes per rank of the layouts whose grids `unit`'s transition sets."""
        n = self.nranks
        memory = np.zeros(n, boxes.INDEX)
        for tensor, writer in self.write_terms.get(unit, []):
            key = ("write", writer, self.grid(writer, grids), tensor)
            memory += self._volume(key, tensor)
        for tensor in self.home_terms.get(unit, []):
            memory += self._volume(self._home_key(tensor, grids), tensor)
        return memory

    def _volume(self, key: Key, tensor: str) -> np.ndarray:
        itemsize = self.graph.tensors[tensor].itemsize

        def make() -> np.ndarray:
            if key[0] == "write":
                _, name, grid, _ = key
                found = self._accesses(name, grid).writes[tensor]
                if len(found) == 1:  # one rect per rank, disjoint (else the plan fails)
                    ranks, lo, hi = found[0]
                    volume = boxes.volumes(lo, hi) * itemsize
                    return np.bincount(ranks, weights=volume, minlength=self.nranks).astype(
                        boxes.INDEX
                    )[: self.nranks]
            if key[0] == "home":
                found = self._home_reads(key)
                if found:
                    ranks, lo, hi = found[0]
                    same = all(
                        np.array_equal(r, ranks) and np.array_equal(a, lo) and np.array_equal(b, hi)
                        for r, a, b in found[1:]
                    )
                    if same and len(np.unique(ranks)) == len(ranks):
                        # every reader reads the same rect per rank: the home holds just it
                        volume = boxes.volumes(lo, hi) * itemsize
                        return np.bincount(ranks, weights=volume, minlength=self.nranks).astype(
                            boxes.INDEX
                        )[: self.nranks]
            return self._layout(key).volume_per_rank(self.nranks) * itemsize

        return self._remember(("volume", key, itemsize), make)

    def _home_reads(self, key: Key) -> list:
        """(ranks, lo, hi) of every read making the home `key` (`plan.resident_reads`)."""
        _, source, readers = key
        found = []
        for name, grid in readers:
            pieces = self._pieces(name, grid)
            found += [
                c
                for t, c in resident_reads(self.graph, self.graph.task(name), pieces)
                if t == source
            ]
        return found


_NOTHING = _Moved(None, 0, None, None, None)
#: a layout `UnitPricer.bound` cannot know (written or read on the predecessor's grid)
_UNKNOWN: Key = ("unknown",)


def digest(*arrays: np.ndarray) -> bytes:
    """A 128-bit digest of arrays' shapes, types and contents (a key for what they determine)."""
    found = hashlib.blake2b(digest_size=16)
    for array in arrays:
        array = np.ascontiguousarray(array)
        found.update(f"{array.shape}{array.dtype}".encode())
        found.update(array.view(np.uint8).reshape(-1))
    return found.digest()


def _group_bytes(found: Collectives, n: int) -> np.ndarray:
    """Bytes per rank its collectives hold: each participant the whole of each one's targets."""
    sizes = np.array([len(g) for g in found.groups], boxes.INDEX)
    per_group = np.bincount(found.group, weights=found.total, minlength=len(found.groups))
    ranks = np.concatenate(found.groups + [np.maximum(found.extra, 0)])
    weights = np.concatenate(
        (np.repeat(per_group, sizes), np.where(found.extra >= 0, found.total, 0))
    )
    return np.bincount(ranks, weights=weights, minlength=n).astype(boxes.INDEX)


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
