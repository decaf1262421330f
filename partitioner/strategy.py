"""Strategies: a grid over the iteration space of every partitioned task.

The unit of choice is a *unit*: consecutive forward tasks of one layer group that iterate over the
same space (`L0.filter`, `L0.filterA`, `L0.filterNL` form unit `L0`), together with their backward
tasks. One grid per unit; a backward task whose space differs from its forward task's (softmax's
grad iterates over classes too) keeps the parts of the dims whose extents agree and 1 elsewhere.

Tasks are of two kinds:

- *partitioned*: compute tasks and the `set_zero` of activation gradients and statistics. Piece i
  of the row-major grid runs on rank i (owner computes); a grid of fewer cells than ranks leaves
  the ranks from `cells` on idle for that task. An activation gradient is zeroed on the grid of the
  task that produced the activation, so gradients live where their activations live (the gradient
  of a step input, which imported graphs have, on the grid of its first reader); a statistic
  (the loss, evaluate's sums) on rank 0.
- *homed*: the `data` task, `update` tasks and the `set_zero` of parameter gradients. They touch
  resident tensors, whose home is derived from their readers (see `plan.py`); a homed task runs on
  every rank of that home, each over the cells it holds.

The built-in strategies:

- `data`: every unit split over the batch (dim 0), parameters replicated;
- `model`: split over output channels/features (dim 1; a sequence's last dim) where the unit has
  them, else the batch;
- `spatial`: split over output rows and columns (dims 2, 3; a sequence's tokens) as square as the
  extents allow, where the unit has them, else the batch.

Which dim is which comes from each task's `axis_roles`.

Each uses as many ranks as the extents allow (at most R; a 256-sample batch on 1024 ranks uses 256).
A user-given grid must cut the unit into exactly R non-empty pieces along splittable dims (or as
many as their extents allow, where that is fewer: evaluate's accuracy is one piece). It may
name the dims the unit's reducer sums over after its output dims (a linear unit's grid is over
(N, M, 1, 1, C, H, W), a filter's over (N, K, P, Q, C); see `reduction_split`), or give the output
dims alone, leaving the sums whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from weakref import WeakKeyDictionary

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import RESIDENT_KINDS, Task
from legion_nn.micro_batches import micro_name, stages_of
from legion_nn.op_records import (
    HOME,
    WITH_TENSOR,
    axis_roles,
    output_ndim,
    record_of,
    reduction_dims,
    splittable_dims,
)
from partitioner.reduction_split import Grid, output_grid

#: the fixed strategies; with `auto`, every name `--strategy` takes besides a grids file
BUILTIN = ("data", "model", "spatial")
STRATEGY_NAMES = (*BUILTIN, "auto")


@dataclass(frozen=True)
class Unit:
    """Forward tasks sharing one grid; `backward` are their gradient tasks.

    `extents` is the space of the unit's widest task: its output, then the dims `reducer` (that
    task, if it sums over any) sums over, `summed`. A grid of the unit cuts that space; the
    unit's other tasks run on its `reduction_split.output_grid`."""

    name: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    extents: tuple[int, ...]
    splittable: tuple[int, ...]
    summed: tuple[int, ...] = ()
    reducer: str | None = None
    #: each dim's role to the built-in strategies (`legion_nn.registry.axis_roles`)
    axes: str = ""


def strategy_label(name: str, sharded: frozenset[str]) -> str:
    """A strategy as people read it: its name, and the homes where any are sharded
    (`data, sharded homes`)."""
    return f"{name}, sharded homes" if sharded else name


def grid_label(grid: Grid, summed: int = 0) -> str:
    """A grid as people read it, `2×4×1×1`; where it cuts the last `summed` dims (those its
    reducer sums over) they follow a `Σ`, `1×1×1×1 Σ8×1×1`, and are left out otherwise."""
    head, tail = grid[: len(grid) - summed], grid[len(grid) - summed :]
    text = "×".join(map(str, head))
    return f"{text} Σ{'×'.join(map(str, tail))}" if any(p > 1 for p in tail) else text


def cells(grid: Grid) -> int:
    n = 1
    for parts in grid:
        n *= parts
    return n


def param_of(graph: TaskGraph, tensor: str) -> str | None:
    """The parameter a resident tensor belongs to (itself, its gradient, its optimizer state)."""
    if tensor in graph.tensors and graph.tensors[tensor].kind == "param":
        return tensor
    base = tensor.removesuffix(".grad")
    if base != tensor and base in graph.tensors and graph.tensors[base].kind == "param":
        return base  # `<param>.grad`, in graphs with or without update tasks (imported ones)
    return _owners(graph).get(tensor)


#: per graph, the parameter owning each tensor an update task touches (`_owners`)
_OWNERS: WeakKeyDictionary[TaskGraph, dict[str, str]] = WeakKeyDictionary()


def _owners(graph: TaskGraph) -> dict[str, str]:
    """Each tensor of a task with an owner role (an update), mapped to the first such task's
    owner: made once per graph, as planners ask for hundreds of tensors."""
    found = _OWNERS.get(graph)
    if found is None:
        found = {}
        for task in graph.tasks:
            owner = record_of(task.op).owner_role
            if owner is not None:
                param = task.requirement(owner).tensor
                for req in task.requirements:
                    found.setdefault(req.tensor, param)
        _OWNERS[graph] = found
    return found


def is_homed(graph: TaskGraph, task: Task) -> bool:
    """Whether `task` runs where its resident tensors live rather than on a grid of its own."""
    homing = record_of(task.op).homing
    if homing == HOME:
        return True
    if all(
        graph.tensors[r.tensor].kind == "state" for r in task.requirements if r.privilege.writes
    ):
        return any(r.privilege.writes for r in task.requirements)  # e.g. running statistics
    if homing == WITH_TENSOR:
        tensor = graph.tensors[task.requirements[0].tensor]
        return tensor.kind in RESIDENT_KINDS or param_of(graph, tensor.name) is not None
    return False


def find_units(graph: TaskGraph) -> list[Unit]:
    """The units of `graph`, in program order of their first forward task. The copies of a
    task that micro-batches make (`legion_nn.micro_batches`) join the unit of the first
    micro-batch's, which is named and shaped by it: one grid for every micro-batch."""
    groups: list[list[Task]] = []
    copies = [0]
    for task in graph.tasks:
        if task.phase != "forward" or is_homed(graph, task):
            continue
        micro_batch = task.attrs.get("micro_batch")
        if micro_batch:
            copies.append(micro_batch)
            continue
        last = groups[-1][-1] if groups else None
        if last is not None and last.layer == task.layer and _output(last) == _output(task):
            groups[-1].append(task)
        else:
            groups.append([task])
    names = [g[0].layer for g in groups]
    known = {task.name for task in graph.tasks}
    units = []
    copies = sorted(set(copies))
    for group in groups:
        first = tuple(t.name for t in group)
        forward = first
        if "micro_batch" in group[0].attrs:
            forward = tuple(micro_name(_first_name(name), m) for m in copies for name in first)
        backward = tuple(f"{name}.grad" for name in forward if f"{name}.grad" in known)
        if "micro_batch" in group[0].attrs:  # the micro-batches' weight gradients, deferred
            backward += tuple(
                f"{_first_name(n)}.grad" for n in first if f"{_first_name(n)}.grad" in known
            )
        widest = max(group, key=lambda t: t.space.ndim)
        ndim = widest.space.ndim
        split = set(range(ndim))
        for task in group:  # a task without the reduction dims leaves them to the reducer
            split &= set(splittable_dims(task)) | set(range(task.space.ndim, ndim))
        summed = reduction_dims(widest)
        name = group[0].layer if names.count(group[0].layer) == 1 else _first_name(group[0].name)
        units.append(
            Unit(
                name,
                forward,
                backward,
                widest.space.shape,
                tuple(sorted(split)),
                summed,
                widest.name if summed else None,
                axis_roles(widest),
            )
        )
    return units


def forward_of(graph: TaskGraph, backward: str) -> str:
    """The forward task whose grid backward task `backward` follows: its own, or for the
    micro-batches' weight gradients deferred into one task (`legion_nn.micro_batches`), the first
    micro-batch's, whose space it has."""
    name = backward.removesuffix(".grad")
    return micro_name(name, 0) if "micro_rows" in graph.task(backward).attrs else name


def _first_name(name: str) -> str:
    """The name of a task of micro-batch 0 without its `@0`."""
    return name.removesuffix("@0")


def _output(task: Task) -> tuple[int, ...]:
    return task.space.shape[: output_ndim(task)]


def unit_task_grid(graph: TaskGraph, unit: Unit, name: str, grid: Grid) -> Grid:
    """The grid of forward task `name` of `unit` when the unit runs on `grid`."""
    if unit.reducer is None or graph.task(name).space.ndim == len(grid):
        return grid
    return output_grid(graph.task(unit.reducer), grid)


def aligned_grid(graph: TaskGraph, source: Task, source_grid: Grid, task: Task) -> Grid:
    """The grid of a task serving the output of `source` (run on `source_grid`), such as the
    zeroing of its gradient: where that output lives, carried to `task`'s space by position."""
    grid = output_grid(source, source_grid)
    return _aligned(grid, source.space.shape[: len(grid)], task.space.shape)


@lru_cache(maxsize=4096)
def balanced(extents: tuple[int, ...], dims: tuple[int, ...], nranks: int) -> Grid:
    """The grid over `dims` with the most cells (at most `nranks`, parts within the extents),
    as square as possible among those; the first such in `factorizations`' order (found once
    per extents, dims and ranks: a search asks the families' grids of each unit many times).

    A grid with the most cells has, given its other parts, the most parts its last dim allows,
    so only those grids are visited (in `factorizations`' order)."""
    best: tuple[int, int, Grid] = (0, 0, (1,) * len(extents))
    grid = [1] * len(extents)

    def visit(i: int, room: int) -> None:
        nonlocal best
        if i == len(dims) - 1 or not dims:
            if dims:
                grid[dims[i]] = min(room, extents[dims[i]])
            parts = [grid[d] for d in dims] or [1]  # no dim to cut: the one-cell grid
            key = (cells(tuple(grid)), -(max(parts) - min(parts)))
            if key > best[:2]:
                best = (*key, tuple(grid))
            return
        d = dims[i]
        for parts in range(1, min(room, extents[d]) + 1):
            grid[d] = parts
            visit(i + 1, room // parts)
        grid[d] = 1

    visit(0, nranks)
    return best[2]


def factorizations(extents: tuple[int, ...], dims: tuple[int, ...], limit: int) -> list[Grid]:
    """Every grid cutting only `dims`, each part count within its extent, at most `limit` cells."""
    out: list[Grid] = []

    def extend(grid: list[int], i: int, room: int) -> None:
        if i == len(dims):
            out.append(tuple(grid))
            return
        d = dims[i]
        for parts in range(1, min(room, extents[d]) + 1):
            grid[d] = parts
            extend(grid, i + 1, room // parts)
        grid[d] = 1

    extend([1] * len(extents), 0, limit)
    return out


def builtin_grid(unit: Unit, strategy: str, nranks: int) -> Grid:
    """The grid of `unit` under a built-in strategy."""
    role = {"data": "N", "model": "F", "spatial": "S"}[strategy]
    preferred = [d for d, r in enumerate(unit.axes) if r == role]
    dims = tuple(d for d in preferred if d in unit.splittable and d < len(unit.extents))
    if not dims or all(unit.extents[d] == 1 for d in dims):
        dims = (0,) if 0 in unit.splittable else ()
    return balanced(unit.extents, dims, nranks)


def check_grid(unit: Unit, grid: Grid, nranks: int, given: Grid | None = None) -> None:
    """A user-given grid must cut `unit` into exactly `nranks` non-empty pieces (fewer where its
    splittable extents allow no more); errors quote it as `given` (the output dims alone, when
    the user left out the reduction dims)."""
    shown = list(given if given is not None else grid)
    if len(grid) != len(unit.extents):
        outputs = len(unit.extents) - len(unit.summed)
        also = (
            f" (the first {outputs} its output's; give those alone or all)" if unit.summed else ""
        )
        raise LegionNNError(
            f"grid {shown} for {unit.name} has {len(grid)} dims; its space "
            f"{list(unit.extents)} has {len(unit.extents)}{also}"
        )
    for d, (parts, extent) in enumerate(zip(grid, unit.extents)):
        if parts < 1 or parts > extent:
            raise LegionNNError(
                f"grid {shown} for {unit.name}: dim {d} of extent {extent} cannot be cut "
                f"into {parts} non-empty parts"
            )
        if parts > 1 and d not in unit.splittable:
            raise LegionNNError(
                f"grid {shown} for {unit.name}: dim {d} cannot be split "
                f"(splittable dims: {list(unit.splittable)})"
            )
    most = cells(tuple(unit.extents[d] for d in unit.splittable))
    if cells(grid) != min(nranks, most):
        why = "(one per rank)" if most >= nranks else "(as many as its extents allow)"
        raise LegionNNError(
            f"grid {shown} for {unit.name} makes {cells(grid)} pieces, not "
            f"{min(nranks, most)} {why}"
        )


def backward_grid(forward: Task, backward: Task, grid: Grid) -> Grid:
    """A backward task's grid: its forward grid on the dims of equal extent, 1 elsewhere."""
    return tuple(
        g if f == b else 1 for g, f, b in zip(grid, forward.space.shape, backward.space.shape)
    )


def task_grids(graph: TaskGraph, unit_grids: Mapping[str, Grid]) -> dict[str, Grid]:
    """Grids of every partitioned task, from one grid per unit."""
    return task_placement(graph, unit_grids)[0]


def task_placement(
    graph: TaskGraph, unit_grids: Mapping[str, Grid], unit_ranks: Mapping[str, int] | None = None
) -> tuple[dict[str, Grid], dict[str, int]]:
    """Grids of every partitioned task, from one grid per unit, and the first rank of each
    task's pieces (a unit's from `unit_ranks`, a pipeline stage's; a helper's that of the task
    it serves; 0 by default)."""
    unit_ranks = unit_ranks or {}
    grids: dict[str, Grid] = {}
    first: dict[str, int] = {}
    for unit in find_units(graph):
        grid = unit_grids[unit.name]
        for name in unit.forward:
            grids[name] = unit_task_grid(graph, unit, name, grid)
            first[name] = unit_ranks.get(unit.name, 0)
        for name in unit.backward:
            forward = forward_of(graph, name)
            grids[name] = backward_grid(graph.task(forward), graph.task(name), grids[forward])
            first[name] = first[forward]
    producer: dict[str, str] = {}
    reader: dict[str, str] = {}
    for task in graph.tasks:
        for req in task.requirements:
            if req.write_rect is not None and task.name in grids:
                producer.setdefault(req.tensor, task.name)
            if req.read_rect is not None and not req.read_rect.is_empty() and task.name in grids:
                reader.setdefault(req.tensor, task.name)
    for task in graph.tasks:
        if task.name in grids or is_homed(graph, task):
            continue
        target = graph.tensors[task.requirements[0].tensor]
        base = target.name.removesuffix(".grad")
        # the gradient of a step input (imported graphs have them) lives where it is first read
        source = producer.get(base) or reader.get(base)
        if task.op == "set_zero" and source is not None and target.kind == "grad":
            grids[task.name] = aligned_grid(graph, graph.task(source), grids[source], task)
            first[task.name] = first[source]
        else:
            grids[task.name] = (1,) * task.space.ndim
            # a step's statistic (the loss, evaluate's counts) lives on the stage computing it
            first[task.name] = first.get(producer.get(target.name, ""), 0)
    return grids, first


def _aligned(grid: Grid, source: tuple[int, ...], target: tuple[int, ...]) -> Grid:
    """`grid` over the `source` extents carried to `target`: its parts on the dims (by position)
    whose extents agree, 1 elsewhere."""
    return tuple(
        grid[d] if d < len(source) and source[d] == extent else 1 for d, extent in enumerate(target)
    )


@dataclass(frozen=True)
class Strategy:
    """A named choice of one grid per unit, and of the parameters whose homes are sharded.

    A parameter's home holds, on each rank, what that rank's pieces read of it (`plan.py`): a
    parameter every batch piece reads whole is replicated. Where `sharded` names it, every part
    held by several ranks is cut among them instead (`Layout.sharded`), and its gradient and
    optimizer state with it: each rank keeps one shard, its readers fetch the rest just before
    they use it and drop it after (an all-gather), its gradient's partial sums reduce onto the
    shards (a reduce-scatter), and the update runs on each shard, as in ZeRO-3 and FSDP.

    A strategy `search.auto` chose also carries, as `pieces`, the `pieces.PieceCache` of its
    grids on the graph it searched (the search computed them), which `plan.build_plan` reuses
    for that graph; the cache stays in the process (it is not pickled)."""

    name: str
    unit_grids: dict[str, Grid]
    sharded: frozenset[str] = frozenset()
    #: per unit, the first rank of its pieces (a pipeline stage's, `partitioner.pipeline`);
    #: absent: rank 0
    unit_ranks: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return strategy_label(self.name, self.sharded)

    def task_grids(self, graph: TaskGraph) -> dict[str, Grid]:
        return task_grids(graph, self.unit_grids)

    def task_placement(self, graph: TaskGraph) -> tuple[dict[str, Grid], dict[str, int]]:
        """`task_placement` of this strategy's grids and stages."""
        return task_placement(graph, self.unit_grids, self.unit_ranks)


def builtin(graph: TaskGraph, name: str, nranks: int) -> Strategy:
    """`data`, `model` or `spatial` for `graph` on `nranks` ranks; in a pipeline's stages
    (`partitioner.pipeline`), within each stage, over its share of the ranks."""
    if name not in BUILTIN:
        raise LegionNNError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    check_ranks(nranks)
    units = find_units(graph)
    share, first = stage_ranks(graph, units, nranks)
    return Strategy(name, {u.name: builtin_grid(u, name, share) for u in units}, unit_ranks=first)


def stage_ranks(graph: TaskGraph, units: list[Unit], nranks: int) -> tuple[int, dict[str, int]]:
    """The ranks each unit's grid cuts it over (its pipeline stage's share of `nranks`,
    `partitioner.pipeline`; all of them without stages) and the first of them per unit (none
    without stages: rank 0)."""
    stages = stages_of(graph)
    if stages == 1:
        return nranks, {}
    if nranks % stages:
        raise LegionNNError(f"--stages {stages} does not divide the {nranks} ranks")
    share = nranks // stages
    return share, {u.name: graph.task(u.forward[0]).attrs.get("stage", 0) * share for u in units}


def from_grids(graph: TaskGraph, grids: Mapping[str, list[int]], nranks: int) -> Strategy:
    """A user-given strategy: a grid for every unit, each cutting it into `nranks` pieces (in a
    pipeline, its stage's share of them)."""
    check_ranks(nranks)
    units = {u.name: u for u in find_units(graph)}
    share, first = stage_ranks(graph, list(units.values()), nranks)
    unknown = sorted(set(grids) - set(units))
    if unknown:
        raise LegionNNError(f"grid for unknown unit {unknown[0]!r}; units: {', '.join(units)}")
    out = {}
    for name, unit in units.items():
        if name not in grids:
            raise LegionNNError(f"no grid for unit {name!r}")
        grid = grids[name]
        if not isinstance(grid, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in grid
        ):
            raise LegionNNError(f"grid for {name} must be a list of ints, got {grid!r}")
        given = tuple(grid)
        grid = given
        if unit.summed and len(grid) == len(unit.extents) - len(unit.summed):
            grid += (1,) * len(unit.summed)  # a grid of the output alone: the sums stay whole
        check_grid(unit, grid, share, given)
        out[name] = grid
    return Strategy("custom", out, unit_ranks=first)


def check_ranks(nranks: int) -> None:
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise LegionNNError(f"the number of ranks must be a positive int, got {nranks!r}")


#: `--param-homes`: every parameter's home replicated where its readers read it whole, or sharded
PARAM_HOMES = ("replicated", "sharded")


def check_param_homes(homes: str | None) -> None:
    if homes is not None and homes not in PARAM_HOMES:
        raise LegionNNError(
            f"--param-homes: unknown choice {homes!r}; choose one of {', '.join(PARAM_HOMES)}"
        )


def with_homes(graph: TaskGraph, strategy: Strategy, homes: str) -> Strategy:
    """`strategy` with every parameter's home `homes` (one of `PARAM_HOMES`)."""
    check_param_homes(homes)
    params = frozenset(n for n, t in graph.tensors.items() if t.kind == "param")
    return replace(strategy, sharded=params if homes == "sharded" else frozenset())
