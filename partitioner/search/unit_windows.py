"""What each unit's row depends on, found once per graph: the static half of `transitions.py`.

For every task, the unit whose grid it runs on and how its grid follows from that unit's
(`rule`); which tensors live in a home and whose readers make it; for every unit, the units its
row depends on (`deps`), the *window* of tasks its replay walks, and the memory terms its row
sets. `transitions.UnitPricer` replays the windows; see its module docstring for what they are
and why.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from partitioner.plan import task_rows
from partitioner.strategy import (
    Grid,
    Unit,
    aligned_grid,
    backward_grid,
    forward_of,
    is_homed,
    param_of,
    unit_task_grid,
)


class NotAChain(Exception):
    """The graph's costs do not split into rows over the units' dependencies."""


class UnitWindows:
    """The rows of `units` in `graph`: their dependencies, windows and memory terms."""

    def __init__(self, graph: TaskGraph, units: Sequence[Unit]) -> None:
        self.graph, self.units = graph, list(units)
        self.rows = task_rows(graph)
        self.homed = {t.name for t in graph.tasks if is_homed(graph, t)}
        self._grids: dict[tuple, Grid] = {}
        self._rules()
        self._homes()
        self._memory_terms()
        self._windows()

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
                self.rule[name] = ("backward", forward_of(graph, name))
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
        #: per row, the positions of its tasks in program order; per tensor, those of the tasks
        #: not homed that touch it: a row's window is found from its own tasks and the tensors
        #: they touch, not by a walk of the whole step per unit
        positions: dict[str | None, list[int]] = defaultdict(list)
        self._accessors: dict[str, list[int]] = defaultdict(list)
        for position, task in enumerate(graph.tasks):
            positions[self.rows[task.name]].append(position)
            if task.name not in self.homed:
                for tensor in dict.fromkeys(r.tensor for r in task.requirements):
                    self._accessors[tensor].append(position)
        constant = sorted(p for row, found in positions.items() if row not in index for p in found)
        self.constant_tasks = [graph.tasks[p].name for p in constant]
        self.window: list[list[str]] = []
        self.costed: list[set[str]] = []
        self.touched: list[set[str]] = []
        #: per unit, the other units whose grids its row's cost depends on (on a chain, the one
        #: before it)
        self.deps: list[tuple[int, ...]] = []
        #: per unit, the units whose grids its row is a function of: itself and `deps`, sorted
        self.scopes: list[tuple[int, ...]] = []
        for i, unit in enumerate(self.units):
            mine = positions.get(unit.name, [])
            touched = self._touched(mine)
            self.deps.append(self._dependencies(i, mine, touched))
            self.scopes.append(tuple(sorted((*self.deps[i], i))))
            self.window.append(self._window(mine, touched, {*self.deps[i], i, None}))
            self.costed.append({graph.tasks[p].name for p in mine})
            self.touched.append(set(touched))
        touched = self._touched(constant)
        self.constant_window = self._window(constant, touched, {None})
        self.constant_touched = set(touched)

    def _others(self, costed: list[int], tensors) -> list[int]:
        """The positions, in program order, of the tasks not in `costed` (positions) and not
        homed that touch one of `tensors`."""
        mine = set(costed)
        return sorted({p for tensor in tensors for p in self._accessors.get(tensor, ())} - mine)

    def _dependencies(self, i: int, costed: list[int], touched: dict[str, int]) -> tuple[int, ...]:
        """The units other than i whose grids unit i's row depends on: the unit before it (whose
        reads of the row's tensors give copies), the units of the tasks that write what the row
        later reads or reduces into (its layouts) or read what the row's forward tasks later
        read (copies: a branch reading the tensor its sibling read), of the row's own tasks run
        on another unit's grid (the zeroing of a gradient, on its producer's), and of every
        reader of a home the row touches or whose memory it counts. A backward task's read is
        not followed: its forward task read the same rect on the same grid before it, unless a
        unit before that did, which the forward's row depends on (see the module docstring).
        `costed`: the positions of the row's tasks, in program order; `touched`: their
        `_touched`."""
        graph = self.graph
        found = {i - 1} if i else set()
        homes = {self.home_source[t] for t in self.home_terms.get(i, [])}
        first_read: dict[str, int] = {}  # by the row's forward tasks
        for position in costed:
            task = graph.tasks[position]
            if task.phase == "forward" and task.name not in self.homed:
                for r in task.requirements:
                    if r.privilege.reads and not graph.tensors[r.tensor].resident:
                        first_read.setdefault(r.tensor, position)
        for position in costed:
            task = graph.tasks[position]
            if task.name not in self.homed:
                found.add(self.unit_of[task.name])
            homes |= {
                self.home_source[r.tensor]
                for r in task.requirements
                if r.tensor in self.home_source
            }
        for position in self._others(costed, [*touched, *first_read]):
            task = graph.tasks[position]
            if _lays_out_for(task, position, touched) or any(
                r.privilege.reads and first_read.get(r.tensor, -1) > position
                for r in task.requirements
            ):
                found.add(self.unit_of[task.name])
        for source in homes:
            found |= self._reader_units(source)
        return tuple(sorted(found - {i, None}))

    def _touched(self, costed: list[int]) -> dict[str, int]:
        """The tensors the non-homed tasks at `costed` (positions, in program order) read or
        reduce into, each with the position of its last such access."""
        touched: dict[str, int] = {}
        for position in costed:
            task = self.graph.tasks[position]
            if task.name not in self.homed:
                for req in task.requirements:
                    if req.privilege.reads or req.privilege is Privilege.REDUCE:
                        touched[req.tensor] = position
        return touched

    def _window(
        self, costed: list[int], touched: dict[str, int], allowed: set[int | None]
    ) -> list[str]:
        """The tasks a row's replay walks, in program order: its own (`costed`, positions in
        program order) and those on the grids `allowed` that touch what it reads or reduces
        into (`touched`, their `_touched`)."""
        graph = self.graph
        mine = set(costed)
        window = []
        for position in sorted(mine.union(self._others(costed, touched))):
            task = graph.tasks[position]
            if position in mine:
                if task.name not in self.homed and self.unit_of[task.name] not in allowed:
                    raise NotAChain(f"task {task.name} runs on the grid of another unit")
                window.append(task.name)
            elif self.unit_of[task.name] in allowed:
                window.append(task.name)
            elif _lays_out_for(task, position, touched):
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


def _lays_out_for(task, position: int, touched: dict[str, int]) -> bool:
    """Whether `task`, at `position` in program order, writes a tensor a row later reads or
    reduces into (`touched`: each tensor with the row's last access): it sets that layout."""
    return any(
        r.tensor in touched
        and r.privilege.writes
        and r.privilege is not Privilege.REDUCE
        and touched[r.tensor] > position
        for r in task.requirements
    )
