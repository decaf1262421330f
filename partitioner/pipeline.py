"""Pipelines: consecutive layers in stages on groups of ranks, micro-batches streamed through them.

R ranks in S stages give each stage R/S ranks. `stage_cuts` cuts the graph's
units, in program order, into S contiguous groups of about equal work (the FLOPs of their
forward and backward tasks: the contiguous partition whose heaviest stage is lightest). A
strategy inside the stages is any strategy's grids over R/S ranks, each unit's pieces
placed on its stage's ranks (`Strategy.unit_ranks`, which `strategy.builtin` sets from each
task's `stage`): two levels, as in Alpa. The plan then
derives everything else as for any grids: an activation that crosses a stage boundary is a copy
from the ranks that wrote it to those that read it, and a gradient going back the same.

`pipelined` makes the step: the batch as M micro-batches (`legion_nn.micro_batches`), every
stage running its micro-batches' forwards (F) and backwards (B) in the schedule's order, and the
step's task list one sequential program that holds every stage's order (`_merge`):

- `gpipe`: F0 … F(M−1), then B0 … B(M−1), on every stage;
- `1f1b` (PipeDream-flush): stage s runs S − 1 − s forwards ahead, then alternates one
  forward and one backward, then the backwards left; at most S − s micro-batches'
  activations are live on it.

The plan and the rank programs run that order (each rank its stage's tasks of it); the simulator
runs it as it runs, bubbles included.
"""

from __future__ import annotations

from collections.abc import Sequence

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.micro_batches import check_micro_batches, micro_batched, stages_of
from legion_nn.op_records import flops_per_element
from partitioner.plan import task_rows
from partitioner.strategy import find_units


def check_stage_count(stages: int) -> None:
    """Raise `LegionNNError` naming the flag where `stages` is no count of stages."""
    if stages < 1:
        raise LegionNNError(f"--stages must be at least 1, got {stages}")


def check_stages(graph: TaskGraph, stages: int) -> None:
    """Raise `LegionNNError` naming the flag where `graph` cannot be cut into `stages` stages
    (whether they divide the ranks, `strategy.builtin` checks)."""
    check_stage_count(stages)
    units = len(staged_units(graph))
    if stages > units:
        raise LegionNNError(
            f"--stages {stages} is more than the {units} layers of {graph.network or 'the network'}"
        )


def stage_cuts(
    graph: TaskGraph,
    stages: int,
    work: Sequence[float] | None = None,
    boundary: Sequence[float] | None = None,
) -> dict[str, int]:
    """Each unit's stage: the units in program order cut into `stages` contiguous groups, the
    heaviest as light as can be. A unit weighs its `work` (default: the FLOPs of its forward and
    backward tasks), and a stage also what crosses its ends: `boundary[k]`, between units k − 1
    and k, counts on both stages it separates."""
    units = staged_units(graph)
    if work is None:
        work = [_unit_flops(graph, unit) for unit in units]
    count = len(units)
    crossing = list(boundary) if boundary is not None else [0.0] * (count + 1)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the least heaviest stage of units [0, i) in k stages; cut[k][i]: its last cut
    best = [[inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            ends = crossing[i] if i < count else 0.0
            for j in range(k - 1, i):
                weight = prefix[i] - prefix[j] + ends + (crossing[j] if j else 0.0)
                heaviest = max(best[k - 1][j], weight)
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    out: dict[str, int] = {}
    end = count
    for k in range(stages, 0, -1):
        start = cut[k][end]
        for unit in units[start:end]:
            out[unit.name] = k - 1
        end = start
    return out


def cuts_of(of_unit: dict[str, int]) -> tuple[str, ...]:
    """The first unit of every stage after the first, in order: the cuts `pipelined` takes."""
    firsts: dict[int, str] = {}
    for name, stage in of_unit.items():
        firsts.setdefault(stage, name)
    return tuple(firsts[s] for s in sorted(firsts) if s)


def stages_at(graph: TaskGraph, cuts: Sequence[str]) -> dict[str, int]:
    """Each unit's stage where a stage begins at every unit `cuts` names (in program order)."""
    units = [u.name for u in staged_units(graph)]
    position = {name: i for i, name in enumerate(units)}
    unknown = [c for c in cuts if c not in position]
    if unknown:
        raise LegionNNError(f"stage cut at {unknown[0]!r}: not a layer; layers: {', '.join(units)}")
    starts = [position[c] for c in cuts]
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise LegionNNError(
            f"stage cuts {', '.join(cuts)}: each names the first layer of a stage after the "
            "first, in the layers' order"
        )
    out = {}
    stage = 0
    for i, name in enumerate(units):
        while stage < len(starts) and starts[stage] <= i:
            stage += 1
        out[name] = stage
    return out


def pipelined(
    graph: TaskGraph,
    stages: int,
    micro_batches: int,
    schedule: str = "1f1b",
    cuts: Sequence[str] | None = None,
) -> tuple[TaskGraph, dict[str, int]]:
    """The step of `graph` in `stages` stages of `micro_batches` micro-batches in `schedule`'s
    order, and each unit's stage (see the module docstring): cut where `cuts` says
    (`stages_at`), by default where `stage_cuts` balances the FLOPs."""
    check_micro_batches(micro_batches, graph.batch, schedule)
    check_stages(graph, stages)
    if cuts is None:
        of_unit = stage_cuts(graph, stages)
    elif len(cuts) != stages - 1:
        raise LegionNNError(f"{stages} stages need {stages - 1} cuts, got {len(cuts)}")
    else:
        of_unit = stages_at(graph, cuts)
    rows = task_rows(graph)
    last = stages - 1
    of_task = {}
    for task in graph.tasks:
        row = rows.get(task.name)
        # the data goes where the first layer reads it; what no layer serves runs on the last
        of_task[task.name] = 0 if task.op == "data" else of_unit.get(row, last)
    split = micro_batched(graph, micro_batches, schedule, of_task)
    return split, of_unit


def step_graph(
    graph: TaskGraph,
    stages: int,
    micro_batches: int,
    schedule: str,
    cuts: Sequence[str] | None = None,
) -> TaskGraph:
    """The step `train` and the commands run: `graph` in `stages` stages (`pipelined`, cut at
    `cuts` where given), or in one, its batch as `micro_batches` micro-batches
    (`micro_batches.micro_batched`)."""
    if stages == 1:
        return micro_batched(graph, micro_batches, schedule)
    return pipelined(graph, stages, micro_batches, schedule, cuts)[0]


def cuts_naming(graph: TaskGraph, stages: Sequence[Sequence[str]], where: str) -> tuple[str, ...]:
    """The cuts of a strategy file's `"stages"` (`where`: the file), each stage's layers named in
    order: together they must be every layer, in the layers' order, each once."""
    units = [u.name for u in staged_units(graph)]
    named = [name for stage in stages for name in stage]
    unknown = [n for n in named if n not in units]
    if unknown:
        raise LegionNNError(
            f"{where}: stage layer {unknown[0]!r} is not a layer; layers: {', '.join(units)}"
        )
    missing = [u for u in units if u not in named]
    if missing:
        raise LegionNNError(f"{where}: the stages leave out layer {missing[0]!r}")
    if named != units or not all(stages):
        raise LegionNNError(
            f"{where}: the stages must hold the layers in their order, each once, none empty "
            f"({', '.join(units)})"
        )
    return tuple(stage[0] for stage in stages[1:])


def stage_table(graph: TaskGraph, nranks: int) -> list[dict]:
    """Per stage of a pipelined graph, its layers (units) and ranks, as `partition --json`
    reports them; empty for a graph without stages."""
    stages = stages_of(graph)
    if stages == 1:
        return []
    share = nranks // stages
    table = [
        {"layers": [], "ranks": list(range(s * share, (s + 1) * share))} for s in range(stages)
    ]
    for unit in staged_units(graph):
        table[graph.task(unit.forward[0]).attrs["stage"]]["layers"].append(unit.name)
    return table


def _unit_flops(graph: TaskGraph, unit) -> float:
    tasks = [graph.task(name) for name in (*unit.forward, *unit.backward)]
    return sum(flops_per_element(t, graph.tensors) * t.space.volume for t in tasks)


def staged_units(graph: TaskGraph):
    """The units a pipeline cuts into stages: every unit with a backward pass (the evaluation's
    scalar tasks go with the last stage)."""
    return [u for u in find_units(graph) if u.backward]
