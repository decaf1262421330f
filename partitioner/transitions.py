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
`accounting.received_once`), and each result is kept under a key naming everything it depends
on: a task's pieces by (task, grid); a layout by the task and grid that wrote it, or, for a
home, by its readers' grids; a fetch by the task, its grid, the layout and the copies already
received; a combine by the task, its grid and the layout. So a row's seconds under a transition
are, float for float, what `plan_cost` gives the row of any whole plan with those two grids
(`tests/test_partition_search.py` checks this on random chains), and the work a transition
shares with others (everything of the row that does not depend on the predecessor's grid) is
done once.

Memory. A plan's memory per rank (`accounting.memory_by_unit`) is a sum of terms, and on a chain
each term is set by one transition: a tensor's final layout by the unit whose grid its last
writer runs on; a home (data, a parameter with its gradient and optimizer state) by the later
of the two units reading it; the parts a task receives (once per rank and part over the step),
the partial sums it sends and the buffers of its collectives by its row. `transition` returns
the terms it sets and `constant_memory` the terms no unit sets (tensors on fixed grids), so the
memory of any assignment of grids is their sum, exactly `memory_per_rank` of its whole plan.

The replay leaves out one coupling, the one `coupling.py` leaves out: a task of a third unit
reading a tensor of the row (the next unit's forward reading this unit's output) could give a
rank a copy that a later read of the row then finds. A graph where a task outside the two units
*writes* what the row reads, or where a parameter has readers beyond two consecutive units, is
not priced this way (`NotAChain`); `search.py` then runs its local search over whole plans.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accounting import flops_per_element, pieces_flops, received_once
from partitioner.cost import task_cost
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.messages import Accesses, combine, fetch
from partitioner.pieces import PieceCache, PieceSet, homed_pieces
from partitioner.plan import (
    PlanError,
    Reduction,
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
    reductions: list[Reduction]
    #: bytes held per rank for it: partial sums sent, collective buffers (received parts are
    #: counted per tensor, once per part and rank, from `block`)
    memory: np.ndarray | None
    block: TransferBlock | None


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
        self._rules()
        self._homes()
        self._windows()
        self._memory_terms()
        self._memo: dict[Key, object] = {}
        self.priced = 0

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
        def make() -> Layout:
            if key[0] == "home":
                _, source, readers = key
                found = []
                for name, grid in readers:
                    pieces = self._pieces(name, grid)
                    task = self.graph.task(name)
                    found += [c for t, c in resident_reads(self.graph, task, pieces) if t == source]
                return home_layout(self.graph, source, found)
            _, name, grid, tensor = key
            found = self._accesses(name, grid).writes[tensor]
            return written_layout(self.graph, self.graph.task(name), tensor, found)

        return self._remember(("layout", key), make)

    def _read_rows(self, name: str, grid: Grid, tensor: str) -> tuple[Accesses, np.ndarray]:
        """The task's reads of `tensor` grouped by rect, and its (rect, rank) rows as `Copies`
        records them."""

        def make():
            found = dict(self._accesses(name, grid).reads)[tensor]
            reads = Accesses(*found)
            counts = np.diff(reads.ptr)
            rects = np.concatenate((reads.rect_lo, reads.rect_hi), axis=1)
            rows = np.concatenate((np.repeat(rects, counts, axis=0), reads.ranks[:, None]), axis=1)
            return reads, rows

        return self._remember(("reads", name, grid, tensor), make)

    def _fetch(self, key: Key) -> _Moved:
        def make() -> _Moved:
            _, name, grid, tensor, layout_key, before = key
            reads, rows = self._read_rows(name, grid, tensor)
            fresh = np.ones(len(rows), bool)
            if before:
                held = np.concatenate([self._read_rows(n, g, tensor)[1] for n, g in before])
                ids, _ = boxes.first_seen_ids(np.concatenate((held, rows)))
                fresh = ~np.isin(ids[len(held) :], ids[: len(held)])
            task = self.graph.task(name)
            block = fetch(
                tensor,
                self.graph.tensors[tensor].itemsize,
                self._layout(layout_key),
                reads,
                fresh,
                _failure(task),
            )
            if not len(block):
                return _Moved(None, 0, [], None, None)
            loads = link_loads([block], self.nranks)
            return _Moved(loads, int(np.dot(block.nbytes, block.fanout)), [], None, block)

        return self._remember(key, make)

    def _combine(self, key: Key) -> _Moved:
        def make() -> _Moved:
            _, name, grid, tensor, layout_key = key
            found = dict(self._accesses(name, grid).reduces)[tensor]
            task = self.graph.task(name)
            itemsize = self.graph.tensors[tensor].itemsize
            block, collectives = combine(
                tensor, itemsize, self._layout(layout_key), Accesses(*found), 0, _failure(task)
            )
            reductions = reductions_of(tensor, itemsize, collectives)
            n = self.nranks
            memory = np.zeros(n, boxes.INDEX)
            loads = None
            if len(block):
                loads = link_loads([block], n)
                memory += _per_rank(block.src, block.nbytes, n)
            for reduction in reductions:
                memory[list(reduction.participants)] += reduction.nbytes
                for rect, holders in reduction.targets:
                    memory[list(holders)] -= rect.volume * reduction.itemsize
            wire = int(np.dot(block.nbytes, block.fanout))
            return _Moved(loads, wire, reductions, memory, None)

        return self._remember(key, make)

    def _task_cost(self, name: str, grid: Grid, keys: tuple[Key, ...]) -> tuple[float, object]:
        def make():
            task = self.graph.task(name)
            n = self.nranks
            incoming = [np.zeros(n), np.zeros(n), np.zeros(n)]
            partial = [np.zeros(n), np.zeros(n), np.zeros(n)]
            reductions: list[Reduction] = []
            sent = 0
            memory = None
            for key in keys:
                moved = self._fetch(key) if key[0] == "fetch" else self._combine(key)
                if moved.loads is not None:
                    into = incoming if key[0] == "fetch" else partial
                    for total, part in zip(into, moved.loads):
                        total += part
                reductions += moved.reductions
                sent += moved.wire
                if moved.memory is not None:
                    memory = moved.memory if memory is None else memory + moved.memory
            flops = pieces_flops(self.graph, task, [self._pieces(name, grid)], n)
            cost = task_cost(
                task, self.rows[name], flops, incoming, partial, reductions, sent, self.machine, n
            )
            return cost.seconds, memory

        return self._remember(("task", name, grid, keys), make)

    def _homed_cost(self, name: str, grids: Mapping[int, Grid]) -> float:
        task = self.graph.task(name)
        tensors = [r.tensor for r in task.requirements] if task.op == "data" else []
        tensors = tensors or [task.requirements[0].tensor]
        keys = tuple(self._home_key(t, grids) for t in tensors)

        def make() -> float:
            homes = {t: self._layout(k) for t, k in zip(tensors, keys)}
            n = self.nranks
            flops = pieces_flops(self.graph, task, homed_pieces(self.graph, task, homes), n)
            zero = (np.zeros(n), np.zeros(n), np.zeros(n))
            cost = task_cost(task, self.rows[name], flops, zero, zero, [], 0, self.machine, n)
            return cost.seconds

        return self._remember(("homed", name, keys), make)

    # -- replay ----------------------------------------------------------------------------

    def transition(self, i: int, p: Grid | None, q: Grid) -> RowCost:
        """Unit i's row on grid `q` after unit i − 1 on grid `p` (None for the first unit)."""
        grids = {i: q} if p is None else {i - 1: p, i: q}
        self.priced += 1
        return self._replay(self.window[i], self.costed[i], self.touched[i], grids, i)

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
        graph = self.graph
        layouts: dict[str, Key] = {}
        copies: dict[str, tuple[tuple[str, Grid], ...]] = {}
        fetched: dict[str, list[tuple[bool, Key]]] = defaultdict(list)
        seconds = 0.0
        memory = self._tensor_memory(unit, grids)
        for name in window:
            if name in self.homed:
                if flops_per_element(self.graph.task(name), graph):
                    seconds += self._homed_cost(name, grids)
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
                    if tensor not in self.home_source:
                        raise PlanError(f"task {name} reads {tensor}, which no earlier task wrote")
                    if self.home_source[tensor] == tensor:
                        continue  # a rank's home holds what it reads
                    layout_key = layouts[tensor] = self._home_key(tensor, grids)
                before = copies.get(tensor, ())
                key = ("fetch", name, grid, tensor, layout_key, before)
                copies[tensor] = before + ((name, grid),)
                fetched[tensor].append((mine, key))
                if mine:
                    keys.append(key)
            for tensor in accesses.writes:
                layouts[tensor] = ("write", name, grid, tensor)
                copies[tensor] = ()
            if not mine:
                continue
            for tensor, _ in accesses.reduces:
                layout_key = layouts.get(tensor)
                if layout_key is None:
                    if tensor not in self.home_source:
                        raise PlanError(
                            f"task {name} reduces into {tensor}, which was never zeroed"
                        )
                    layout_key = layouts[tensor] = self._home_key(tensor, grids)
                keys.append(("combine", name, grid, tensor, layout_key))
            task_seconds, held = self._task_cost(name, grid, tuple(keys))
            seconds += task_seconds
            if held is not None:
                memory = memory + held
        for tensor, found in fetched.items():
            if any(mine for mine, _ in found):
                memory = memory + self._received(tuple(found))
        return RowCost(seconds, memory)

    def _received(self, found: tuple[tuple[bool, Key], ...]) -> np.ndarray:
        """Bytes per rank of the parts of one tensor that the row's fetches bring first."""

        def make() -> np.ndarray:
            out = np.zeros(self.nranks, boxes.INDEX)
            moved = [(mine, self._fetch(key).block) for mine, key in found]
            moved = [(mine, block) for mine, block in moved if block is not None]
            if moved:
                held = received_once([block for _, block in moved], self.nranks)
                for (mine, _), part in zip(moved, held):
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
        return self._remember(
            ("volume", key, itemsize),
            lambda: self._layout(key).volume_per_rank(self.nranks) * itemsize,
        )


def _failure(task: Task):
    def fail(message: str) -> PlanError:
        return PlanError(f"task {task.name} {message}")

    return fail


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(ranks, weights=nbytes.astype(float), minlength=n).astype(boxes.INDEX)
