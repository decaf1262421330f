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
those two grids (`tests/partitioner/search/test_auto.py` checks this on random chains and rank counts),
and the work a transition shares with others (everything of the row that does not depend on the
predecessor's grid) is done once.

`UnitPricer.bound(i, q)` replays the row on grid q with the predecessor's tasks left out: tasks
on that grid count 0, and the messages and collectives whose layouts or copies come from the
predecessor's grid are dropped, but for a read of what the predecessor wrote (the row's input),
which counts, per rank, the least bytes and rounds its fetch moves from any of the grids the
search offers the predecessor (`_least_fetch`). What is kept is priced as in `transition`, and a
task's seconds only grow with each rank's bytes and rounds, so the bound is below the row's
seconds after any predecessor. Counting the input's least fetch halved the rows ResNet-50's
search prices on 64 ranks (2,021 to 896; the bounds dearer, the search 3.0 to 2.4 s).
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
for float as in any whole plan with those grids (`tests/partitioner/search/test_auto.py` checks it on
random networks with an add or a concat); `bound` hides all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import NamedTuple

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accounting import flops_per_element, moves_bytes
from partitioner.cost import compute_time
from partitioner.gathers import Adders
from partitioner.machine import Machine
from partitioner.pieces import PieceCache
from partitioner.plan import PlanError
from partitioner.search import families
from partitioner.search.layout_cache import Key, LayoutCache, Memo
from partitioner.search.task_prices import TaskPrices
from partitioner.search.unit_windows import NotAChain, UnitWindows
from partitioner.strategy import (
    Grid,
    Unit,
)

__all__ = ["NotAChain", "RowCost", "UnitPricer", "assignment_cost"]


@dataclass(frozen=True)
class RowCost:
    """One unit's row under one transition."""

    seconds: float
    #: bytes per rank of the memory terms the transition sets before what its fetches bring
    #: (None: no memory counted)
    held: np.ndarray | None = None
    #: the row's fetches that bring parts to a rank: per tensor, its reads' (mine, key) pairs
    fetches: tuple[tuple[tuple[bool, Key], ...], ...] = ()
    prices: TaskPrices | None = field(default=None, repr=False, compare=False)

    @cached_property
    def memory_bound(self) -> np.ndarray | None:
        """At least `memory`: each part a rank receives counted once per fetch that brings it
        (cheap: the searches settle most fits with it)."""
        bound = self.held
        for each in self.fetches:
            bound = bound + self.prices.received_bound(each)
        return bound

    @cached_property
    def memory(self) -> np.ndarray | None:
        """Bytes per rank of the memory terms this transition sets (see the module
        docstring): each part a rank receives counted once, however many fetches bring it."""
        if self.held is None:
            return None
        return sum((self.prices.received(each) for each in self.fetches), self.held)

    def fits(self, base: np.ndarray, capacity: float) -> bool:
        """Whether `base` plus this row's memory is within `capacity` bytes on every rank."""
        if (base + self.memory_bound).max(initial=0) <= capacity:
            return True
        return bool((base + self.memory).max(initial=0) <= capacity)


def assignment_cost(
    rows: Sequence[RowCost], constant: np.ndarray, capacity: float
) -> tuple[float, bool]:
    """The seconds of an assignment's rows, and whether its memory per rank (`constant`, the
    terms no unit sets, and the rows' terms) fits in `capacity` bytes (settled by the rows'
    memory bounds where they fit)."""
    seconds = sum(r.seconds for r in rows)
    if (constant + sum(r.memory_bound for r in rows)).max(initial=0) <= capacity:
        return seconds, True
    return seconds, bool((constant + sum(r.memory for r in rows)).max(initial=0) <= capacity)


class _Replayed(NamedTuple):
    """A window replayed (`UnitPricer._walk`): its costed tasks' seconds, the memory terms it
    sets before what its fetches bring (None: not counted), and those fetches."""

    seconds: float
    held: np.ndarray | None
    fetches: tuple[tuple[tuple[bool, Key], ...], ...]


class UnitPricer(UnitWindows):
    """Prices the rows of a chain's units under transitions (see the module docstring)."""

    def __init__(
        self,
        graph: TaskGraph,
        units: Sequence[Unit],
        nranks: int,
        machine: Machine,
        cache: PieceCache | None = None,
    ) -> None:
        super().__init__(graph, units)
        self.nranks, self.machine = nranks, machine
        self.layouts = LayoutCache(graph, nranks, cache)
        self.prices = TaskPrices(self.layouts, machine)
        self.adders = Adders(graph)
        self.cache = self.layouts.cache
        self._bounds = Memo()
        #: per unit, the grids `auto` offers it (`families.grid_options`): a bound is below
        #: the row whichever of them the units it hides take
        self.options = [list(found) for found in families.grid_options(self.units, nranks)[1]]

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
        return self._row(self._walk(self.window[i], self.costed[i], self.touched[i], grids, i, ()))

    def bound(self, i: int, q: Grid, known: Mapping[int, Grid] | None = None) -> float:
        """A lower bound on unit i's row seconds on grid `q` whatever the grids of the units it
        depends on (`deps`, on a chain unit i − 1): the row's tasks without the messages and
        collectives whose layouts or copies come from their grids (a task's seconds only grow
        with what it moves) but for the reads of what those units wrote, each counted at its
        least over their grids (`_least_fetch`), tasks run on their grids counted as 0. What it
        keeps is priced exactly as in `transition`. `known`: the grids of some of those units, whose tasks are
        then replayed as `factor` replays them; only the others' are hidden (the same argument
        holds: every message kept is one the row moves with those grids)."""
        known = dict(known or {})
        hidden = tuple(d for d in self.deps[i] if d not in known)
        key = (i, q, tuple(sorted(known.items())))
        return self._bounds.remember(key, lambda: self._bound(i, known | {i: q}, hidden))

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

    def _bound(self, i: int, grids: Mapping[int, Grid], hidden: tuple[int, ...]) -> float:
        return self._walk(self.window[i], self.costed[i], self.touched[i], grids, i, hidden).seconds

    def constant(self) -> RowCost:
        """The rows of no unit (data loading) and the memory no unit's grid sets."""
        return self._row(
            self._walk(
                self.constant_window, set(self.constant_tasks), self.constant_touched, {}, None, ()
            )
        )

    def _row(self, replayed: _Replayed) -> RowCost:
        return RowCost(replayed.seconds, replayed.held, replayed.fetches, self.prices)

    def _walk(
        self,
        window: list[str],
        costed: set[str],
        touched: set[str],
        grids: Mapping[int, Grid],
        unit: int | None,
        hidden: tuple[int, ...],
    ) -> _Replayed:
        """The seconds of the `costed` tasks of `window`, replayed in program order, and the
        memory terms `unit`'s transition sets, with the fetches whose parts they count
        (`RowCost`).

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
                requirements = self.graph.task(name).requirements
                read = {req.tensor for req in requirements if req.privilege.reads}
                tainted |= read
                for req in requirements:
                    if req.privilege.writes and req.privilege is not Privilege.REDUCE:
                        if req.tensor in read:
                            layouts[req.tensor] = _UNKNOWN
                        else:  # written anew on one of the hidden unit's grids
                            layouts[req.tensor] = (_HIDDEN, name)
                            copies[req.tensor] = ()
                            tainted.discard(req.tensor)
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
                if layout_key[0] == _HIDDEN:
                    if mine and tensor not in tainted:
                        least = self._least_fetch(name, grid, tensor, layout_key[1], before)
                        if least is not None:
                            keys.append(least)
                    continue
                if layout_key is _UNKNOWN or tensor in tainted or (bounding and not mine):
                    continue
                if self.layouts.local(name, grid, tensor, layout_key, reduce=False):
                    continue  # each rank reads what it wrote: nothing moves
                outright = layout_key[0] == "write" and self._outright(
                    tensor, layout_key[1], layout_key[2], name
                )
                key = ("fetch", name, grid, tensor, layout_key, before, outright)
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
                if layout_key is _UNKNOWN or layout_key[0] == _HIDDEN:
                    continue
                if not self.layouts.local(name, grid, tensor, layout_key, reduce=True):
                    keys.append(("combine", name, grid, tensor, layout_key))
            task_seconds, held = self.prices.task_cost(name, grid, tuple(keys))
            seconds += task_seconds
            if memory is not None and held is not None:
                memory = memory + held
        if memory is None:
            return _Replayed(seconds, None, ())
        found = tuple(tuple(f) for f in fetched.values() if any(mine for mine, _ in f))
        return _Replayed(seconds, memory, found)

    def _outright(self, tensor: str, writer: str, grid: Grid, reader: str) -> bool:
        """Whether `writer` on `grid` wrote `tensor` outright and nothing adds into it before
        `reader` (`gathers.Adders.outright`): a read of all of it may be gathered."""
        accesses, pieces = self.layouts.accesses(writer, grid), self.layouts.pieces(writer, grid)
        return self.adders.outright(tensor, writer, accesses, pieces, reader)

    def _least_fetch(
        self, name: str, grid: Grid, tensor: str, writer: str, before: tuple
    ) -> Key | None:
        """For a bound, task `name`'s read of `tensor` on `grid`, which task `writer` of a
        hidden unit wrote: the least each rank sends, receives and waits rounds for over the
        fetches from that unit's every grid (`options`; a ("least", fetch keys...) key, which
        `TaskPrices.task_cost` prices), below what the read moves on whichever grid the unit
        takes, since a task's seconds only grow with each of them. None where on some grid it
        moves nothing."""
        unit = self.unit_of[writer]
        keys = []
        for option in self.options[unit]:
            try:
                writer_grid = self.grid(writer, {unit: option})
            except (KeyError, NotAChain):  # the writer runs on another hidden unit's grid
                return None
            layout_key = ("write", writer, writer_grid, tensor)
            if self.layouts.local(name, grid, tensor, layout_key, reduce=False):
                return None
            outright = self._outright(tensor, writer, writer_grid, name)
            keys.append(("fetch", name, grid, tensor, layout_key, before, outright))
        return ("least", *dict.fromkeys(keys))

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
#: the first item of the key of a layout `UnitPricer.bound` knows to be one of the hidden
#: unit's grids' (followed by the task of that unit that wrote it)
_HIDDEN = "hidden"
