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

Every step of the replay is the planner's own or computes exactly what it would, and each is kept
under a key naming what it depends on: the layouts and accesses by `layout_cache.py`, what a
task's fetches and combines move and what the task costs by `task_prices.py`. So a row's seconds
under a transition are, float for float, what `plan_cost` gives the row of any whole plan with
those two grids (`tests/test_partition_search.py` checks this on random chains and rank counts),
and the work a transition shares with others (everything of the row that does not depend on the
predecessor's grid) is done once.

`UnitPricer.bound(i, q)` replays the row on grid q with the predecessor's tasks left out: the
messages and collectives whose layouts or copies come from the predecessor's grid are dropped,
tasks on that grid count 0. What is kept is priced as in `transition`, and a task's seconds only
grow with the messages it moves, so the bound is below the row's seconds after any predecessor.
`UnitPricer.compute_bound(i, q)`, the row's computation alone, is a weaker bound that costs
almost nothing; the search refines it to `bound` only where it matters.

Memory. A plan's memory per rank (`accounting.memory_by_unit`) is a sum of terms, and on a chain
each term is set by one transition: a tensor's final layout by the unit whose grid its last
writer runs on; a home (data, a parameter with its gradient and optimizer state) by the later
of the two units reading it; the parts a task receives (once per rank and part over the step),
the partial sums it sends and the buffers of its collectives by its row. `transition` returns
the terms it sets and `constant` the terms no unit sets (tensors on fixed grids), so the
memory of any assignment of grids is their sum, exactly `memory_per_rank` of its whole plan.

The replay leaves out one coupling, the one `coupling.py` leaves out: a task of a third unit
reading a tensor of the row (the next unit's forward reading this unit's output) could give a
rank a copy that a later read of the row's backward then finds.

Graphs that are not chains. A row may depend on units other than its predecessor: the writer
of a residual add's second input, a sibling branch that read the same tensor first, the readers
of a home. `UnitPricer.deps[i]` lists them (on a chain, the predecessor alone), the row's window
admits their tasks, and `UnitPricer.factor(i, grids)` prices the row given their grids, float
for float as in any whole plan with those grids (`tests/test_partition_search.py` checks it on
random networks with an add or a concat); `bound` hides all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accounting import flops_per_element, moves_bytes
from partitioner.cost import compute_time
from partitioner.layout_cache import Key, LayoutCache, Memo
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import PlanError
from partitioner.strategy import (
    Grid,
    Unit,
    aligned_grid,
    backward_grid,
    is_homed,
    param_of,
    unit_task_grid,
)
from partitioner.task_prices import TaskPrices


class NotAChain(Exception):
    """The graph's costs do not split into transitions between consecutive units."""


@dataclass(frozen=True)
class RowCost:
    """One unit's row under one transition."""

    seconds: float
    #: at least `memory`, each part a rank receives counted once per fetch that brings it
    #: (cheap: the searches settle most fits with it)
    memory_bound: np.ndarray | None
    #: makes `memory`
    _exact_memory: Callable[[], np.ndarray] | None = field(default=None, repr=False)

    @cached_property
    def memory(self) -> np.ndarray:
        """Bytes per rank of the memory terms this transition sets (see the module
        docstring): each part a rank receives counted once, however many fetches bring it."""
        return self._exact_memory() if self._exact_memory is not None else self.memory_bound

    def fits(self, base: np.ndarray, capacity: float) -> bool:
        """Whether `base` plus this row's memory is within `capacity` bytes on every rank."""
        if (base + self.memory_bound).max(initial=0) <= capacity:
            return True
        return bool((base + self.memory).max(initial=0) <= capacity)


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
        self.layouts = LayoutCache(graph, nranks, cache)
        self.prices = TaskPrices(self.layouts, machine)
        self.cache = self.layouts.cache
        self.rows = self.prices.rows
        self.homed = {t.name for t in graph.tasks if is_homed(graph, t)}
        self._grids: dict[tuple, Grid] = {}
        self._rules()
        self._homes()
        self._memory_terms()
        self._windows()
        self._bounds = Memo()
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
            return unit_task_grid(self.graph, self.units[unit], name, grids[unit])
        if rule[0] == "backward":
            forward = rule[1]
            return backward_grid(self.graph.task(forward), task, self.grid(forward, grids))
        return aligned_grid(self.graph, self.graph.task(rule[1]), self.grid(rule[1], grids), task)

    def _homes(self) -> None:
        """Which tensors live in a home, whose readers make it, and the units of those."""
        graph = self.graph
        self.home_source: dict[str, str] = {}
        for name, tensor in graph.tensors.items():
            if tensor.kind in ("data", "param"):
                self.home_source[name] = name
        for name, tensor in graph.tensors.items():
            owner = param_of(graph, name)
            if owner is not None and name not in self.home_source:
                self.home_source[name] = owner
            elif tensor.resident and name not in self.home_source:
                self.home_source[name] = name  # state of its own (BatchNorm's running statistics)
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

    def _reader_units(self, source: str) -> set[int]:
        """The units whose grids make the home of `source`."""
        return {self.unit_of[r] for r in self.readers.get(source, [])} - {None}

    def _home_units(self, source: str) -> int | None:
        """The unit whose row sets the home of `source`, its last reader's (None: no unit's
        grid does). On a chain its readers are that unit and the one before it."""
        return max(self._reader_units(source), default=None)

    def _windows(self) -> None:
        graph = self.graph
        index = {unit.name: i for i, unit in enumerate(self.units)}
        self.constant_tasks = [t.name for t in graph.tasks if self.rows[t.name] not in index]
        self.window: list[list[str]] = []
        self.costed: list[set[str]] = []
        self.touched: list[set[str]] = []
        #: per unit, the other units whose grids its row's cost depends on (on a chain, the one
        #: before it)
        self.deps: list[tuple[int, ...]] = []
        for i, unit in enumerate(self.units):
            costed = {t.name for t in graph.tasks if self.rows[t.name] == unit.name}
            self.deps.append(self._dependencies(i, costed))
            self.window.append(self._window(costed, {*self.deps[i], i, None}))
            self.costed.append(costed)
            self.touched.append(set(self._touched(costed)))
        self.constant_window = self._window(set(self.constant_tasks), {None})
        self.constant_touched = set(self._touched(set(self.constant_tasks)))

    def _dependencies(self, i: int, costed: set[str]) -> tuple[int, ...]:
        """The units other than i whose grids unit i's row depends on: the unit before it (whose
        reads of the row's tensors give copies), the units of the tasks that write what the row
        later reads or reduces into (its layouts) or read what the row's forward tasks later
        read (copies: a branch reading the tensor its sibling read), of the row's own tasks run
        on another unit's grid (the zeroing of a gradient, on its producer's), and of every
        reader of a home the row touches or whose memory it counts. A backward task's read is
        not followed: its forward task read the same rect on the same grid before it, unless a
        unit before that did, which the forward's row depends on (see the module docstring)."""
        graph = self.graph
        touched = self._touched(costed)
        found = {i - 1} if i else set()
        homes = {self.home_source[t] for t in self.home_terms.get(i, [])}
        first_read: dict[str, int] = {}  # by the row's forward tasks
        for position, task in enumerate(graph.tasks):
            if task.name in costed and task.phase == "forward" and task.name not in self.homed:
                for r in task.requirements:
                    if r.privilege.reads and not graph.tensors[r.tensor].resident:
                        first_read.setdefault(r.tensor, position)
        for position, task in enumerate(graph.tasks):
            if task.name in costed:
                if task.name not in self.homed:
                    found.add(self.unit_of[task.name])
                homes |= {
                    self.home_source[r.tensor]
                    for r in task.requirements
                    if r.tensor in self.home_source
                }
                continue
            if task.name in self.homed:
                continue
            if any(
                r.tensor in touched
                and r.privilege.writes
                and r.privilege is not Privilege.REDUCE
                and touched[r.tensor] > position
                for r in task.requirements
            ) or any(
                r.privilege.reads and first_read.get(r.tensor, -1) > position
                for r in task.requirements
            ):
                found.add(self.unit_of[task.name])
        for source in homes:
            found |= self._reader_units(source)
        return tuple(sorted(found - {i, None}))

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

    def _home_key(self, tensor: str, grids: Mapping[int, Grid]) -> Key:
        source = self.home_source[tensor]
        readers = tuple((r, self.grid(r, grids)) for r in self.readers.get(source, []))
        return ("home", source, readers)

    # -- replay ----------------------------------------------------------------------------

    def transition(self, i: int, p: Grid | None, q: Grid) -> RowCost:
        """Unit i's row on grid `q` after unit i − 1 on grid `p` (None for the first unit)."""
        return self.factor(i, {i: q} if p is None else {i - 1: p, i: q})

    def factor(self, i: int, grids: Mapping[int, Grid]) -> RowCost:
        """Unit i's row when each unit of `self.deps[i]`, and unit i, run on `grids`."""
        self.priced += 1
        return RowCost(*self._walk(self.window[i], self.costed[i], self.touched[i], grids, i, ()))

    def bound(self, i: int, q: Grid) -> float:
        """A lower bound on unit i's row seconds on grid `q` whatever the grids of the units it
        depends on (`deps`, on a chain unit i − 1): the row's tasks without the messages and
        collectives whose layouts or copies come from their grids (a task's seconds only grow
        with what it moves), tasks run on their grids counted as 0. What it keeps is priced
        exactly as in `transition`."""
        return self._bounds.remember((i, q), lambda: self._bound(i, q))

    def compute_bound(self, i: int, q: Grid) -> float:
        """A lower bound on unit i's row seconds on grid `q` much cheaper than `bound`: what the
        row's tasks on a known grid compute, each message, homed task and task on the
        predecessor's grid counted 0 (a task's seconds are its computation plus its messages)."""

        def make() -> float:
            total = 0.0
            for name in self.window[i]:
                if name not in self.costed[i] or name in self.homed:
                    continue
                if self.unit_of[name] not in (i, None):
                    continue
                task = self.graph.task(name)
                # the busiest rank's FLOPs from the grid alone, its largest cell (uneven splits
                # are ceil-sized first): no access map, and no memory traffic (which only
                # lengthens a task where the machine prices it)
                grid = self.grid(name, {i: q})
                largest = prod(-(-extent // parts) for extent, parts in zip(task.space.shape, grid))
                flops = np.array([flops_per_element(task, self.graph) * float(largest)])
                total += compute_time(task, flops, None, self.machine)
            return total

        return self._bounds.remember(("compute", i, q), make)

    def _bound(self, i: int, q: Grid) -> float:
        hidden = self.deps[i]
        return self._walk(self.window[i], self.costed[i], self.touched[i], {i: q}, i, hidden)[0]

    def constant(self) -> RowCost:
        """The rows of no unit (data loading) and the memory no unit's grid sets."""
        return RowCost(
            *self._walk(
                self.constant_window,
                set(self.constant_tasks),
                self.constant_touched,
                {},
                None,
                (),
            )
        )

    def _walk(
        self,
        window: list[str],
        costed: set[str],
        touched: set[str],
        grids: Mapping[int, Grid],
        unit: int | None,
        hidden: tuple[int, ...],
    ) -> tuple[float, np.ndarray | None, Callable[[], np.ndarray] | None]:
        """The seconds of the `costed` tasks of `window`, replayed in program order, and the
        memory terms `unit`'s transition sets: a bound counting each fetch's parts, and how to
        count each part once (`RowCost`).

        `hidden` are the units whose grids are unknown, for `bound` (none: `transition`, every
        grid known): their tasks are left out, the tensors they write have unknown layouts and those
        they read unknown copies, and the messages and collectives that would need either are
        dropped; a home read on its grid is unknown too. No memory is counted then."""
        bounding = bool(hidden)
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
            if bounding and self.unit_of[name] in hidden:
                for req in self.graph.task(name).requirements:
                    if req.privilege.reads:
                        tainted.add(req.tensor)
                    elif req.privilege.writes and req.privilege is not Privilege.REDUCE:
                        layouts[req.tensor] = _UNKNOWN
                continue
            grid = self.grid(name, grids)
            accesses = self.layouts.accesses(name, grid)
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
                if self.layouts.local(name, grid, tensor, layout_key, reduce=False):
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
                if not self.layouts.local(name, grid, tensor, layout_key, reduce=True):
                    keys.append(("combine", name, grid, tensor, layout_key))
            task_seconds, held = self.prices.task_cost(name, grid, tuple(keys))
            seconds += task_seconds
            if memory is not None and held is not None:
                memory = memory + held
        if memory is None:
            return seconds, None, None
        found = [tuple(f) for f in fetched.values() if any(mine for mine, _ in f)]
        bound = memory
        for each in found:
            bound = bound + self.prices.received_bound(each)

        def exact() -> np.ndarray:
            return sum((self.prices.received(each) for each in found), memory)

        return seconds, bound, exact

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

    def _homed_cost(self, name: str, grids: Mapping[int, Grid]) -> float:
        task = self.graph.task(name)
        if task.op == "data":
            tensors = [r.tensor for r in task.requirements]
        else:  # the home of its first resident tensor, as `pieces.homed_pieces` runs it
            tensors = [next(r.tensor for r in task.requirements if r.tensor in self.home_source)]
        home_keys = tuple((t, self._home_key(t, grids)) for t in tensors)
        return self.prices.homed_cost(name, home_keys)

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

    def _tensor_memory(self, unit: int | None, grids: Mapping[int, Grid]) -> np.ndarray:
        """Bytes per rank of the layouts whose grids `unit`'s transition sets (kept by the
        layouts' keys, which transitions sharing the unit's grid mostly share; read-only)."""
        writes = tuple(
            (("write", writer, self.grid(writer, grids), tensor), tensor)
            for tensor, writer in self.write_terms.get(unit, [])
        )
        homes = tuple((self._home_key(t, grids), t) for t in self.home_terms.get(unit, []))

        def make() -> np.ndarray:
            memory = np.zeros(self.nranks, boxes.INDEX)
            for key, tensor in writes + homes:
                memory += self.layouts.volume(key, tensor)
            memory.flags.writeable = False
            return memory

        return self._bounds.remember(("memory", writes, homes), make)


#: a layout `UnitPricer.bound` cannot know (written or read on the predecessor's grid)
_UNKNOWN: Key = ("unknown",)
