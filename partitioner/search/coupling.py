"""Coupling: which units' grids the cost of each task depends on, and whether units form a chain.

A task's cost (see `cost.py`) depends on

- the grid it runs on, when it computes anything: its unit's, or for the `set_zero` of an
  activation's gradient the grid of the activation's producer (`strategy.task_grids`);
- for each non-resident tensor it reads or reduces into, the grid of the task that last wrote it
  (the layout its messages come from or go to);
- for a resident tensor's gradient it reduces into, and for a homed task that computes (an
  update), the grids of every task reading the parameter (its home).

Units form a *chain* when every task's cost depends only on the grid of its table row's unit and
of the unit before it. Then a unit's cost is a function of two grids, and `search.py` finds the
best assignment exactly by dynamic programming. Networks without branches lower to chains; a
graph where a tensor feeds two units (an auxiliary head, a skip connection) or a parameter is
shared is not one, and `search.py` runs its DP over each row's dependencies instead.

One coupling is left out: a rect received by one task is not sent again to a later reader on the
same rank, so a unit's backward task that re-read a remote part of its own output could ride on
what the next unit's forward fetched. The built-in layers' backward tasks read their outputs on
the forward's grid, from their own cells, so this does not arise for them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from legion_nn.graph import TaskGraph
from legion_nn.op_records import record_of
from legion_nn.privilege import Privilege
from partitioner.accounting import flops_per_element
from partitioner.strategy import Unit, is_homed


def grid_owners(graph: TaskGraph, units: Sequence[Unit]) -> dict[str, int | None]:
    """For each task, the index of the unit whose grid it runs on (None: a fixed grid or a home)."""
    owner: dict[str, int | None] = {task.name: None for task in graph.tasks}
    for index, unit in enumerate(units):
        for name in unit.forward + unit.backward:
            owner[name] = index
    producer: dict[str, str] = {}
    for task in graph.tasks:
        for req in task.requirements:
            if req.write_rect is not None and owner[task.name] is not None:
                producer.setdefault(req.tensor, task.name)
    for task in graph.tasks:
        if task.op != "set_zero" or is_homed(graph, task) or owner[task.name] is not None:
            continue
        target = graph.tensors[task.requirements[0].tensor]
        source = producer.get(target.name.removesuffix(".grad"))
        if source is not None and target.kind == "grad":
            owner[task.name] = owner[source]
    return owner


def cost_dependencies(graph: TaskGraph, units: Sequence[Unit]) -> dict[str, set[int]]:
    """For each task, the units whose grids its predicted cost depends on."""
    owner = grid_owners(graph, units)
    params = {
        req.tensor: task.requirement(role).tensor
        for task in graph.tasks
        if (role := record_of(task.op).owner_role) is not None
        for req in task.requirements
    }
    params.update((n, n) for n, t in graph.tensors.items() if t.kind == "param")
    deps: dict[str, set[int]] = defaultdict(set)
    readers_of: dict[str, set[int]] = defaultdict(set)
    for task in graph.tasks:
        for req in task.requirements:
            home = params.get(req.tensor, req.tensor)
            if req.privilege.reads and owner[task.name] is not None:
                readers_of[home].add(owner[task.name])
    writer: dict[str, str] = {}
    for task in graph.tasks:
        mine = owner[task.name]
        computes = bool(flops_per_element(task, graph))
        if mine is not None and computes:
            deps[task.name].add(mine)
        for req in task.requirements:
            home = params.get(req.tensor, req.tensor)
            if graph.tensors[req.tensor].resident or home != req.tensor:
                homed = is_homed(graph, task)
                if (homed and computes) or req.privilege is Privilege.REDUCE:
                    deps[task.name] |= readers_of[home]
                continue
            touches = req.privilege.reads or req.privilege is Privilege.REDUCE
            if touches and req.tensor in writer and owner[writer[req.tensor]] is not None:
                deps[task.name].add(owner[writer[req.tensor]])
        for req in task.requirements:
            if req.privilege.writes and req.privilege is not Privilege.REDUCE:
                writer[req.tensor] = task.name
    return dict(deps)


def is_chain(graph: TaskGraph, units: Sequence[Unit], rows: Mapping[str, str]) -> bool:
    """Whether each task's cost depends only on its row's unit and the unit before it."""
    index = {unit.name: i for i, unit in enumerate(units)}
    for name, found in cost_dependencies(graph, units).items():
        if not found:
            continue
        row = index.get(rows[name])
        if row is None or not found <= {row - 1, row}:
            return False
    return True
