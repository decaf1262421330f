"""`--stages auto`: the number of stages, of micro-batches and the cuts, chosen by prediction.

The search is Alpa's inter-operator pass, with the commands' own prediction as the last word.
For every stage count S dividing the R ranks (S no more than the layers) and every micro-batch
count M it may try (the one `--micro-batches` gives, else S, 2·S and 4·S up to the batch):

1. Each layer's seconds on R/S ranks are the cost model's rows (`cost.unit_seconds`) of the
   unsplit step under each family the stages may use (`--strategy`'s, or under `auto` every
   built-in the graph allows, each layer taking its cheapest), a micro-batch's share of them 1/M.
2. The cuts are `pipeline.stage_cuts`'s DP over contiguous groups of layers, each layer weighing
   its seconds and each cut the seconds its crossing activations take over the link between the
   stages (`_crossing_bytes`, both ways): the heaviest stage as light as can be.
3. The pipeline's step is then estimated as a schedule's is, Σ stages + (M − 1) · heaviest stage
   (GPipe's and 1F1B's length alike, as in Alpa).

The `TOP` candidates of least estimate, and the step without stages (S = 1), are then predicted
(each under every schedule tried: `--schedule`'s, else `AUTO_SCHEDULES` where the step has
weight gradients to defer and its prediction simulates it; a bulk-synchronous sum counts the
same work under each schedule, not the bubbles or the order that set them apart: vgg19's
pipelines on 1024 ranks summed alike to 16 digits, and the second schedule took 17 of the
search's 39 s) by `predict`, the commands' prediction of the plan they would run (the step simulator's, which
runs the schedule with its bubbles, its messages overlapping compute, and memory), and the least
predicted is chosen. The estimate only ranks; nothing is chosen on it alone, so a pipeline is
chosen exactly when its plan is predicted faster than every other tried, the unstaged one
included. What the estimate leaves out (a layer's gradient sums run once a step, not once per
micro-batch; transitions between grids inside a stage) can misrank candidates the prediction
never sees: `TOP` is how many get that second look.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from legion_nn.graph import TaskGraph
from legion_nn.micro_batches import DEFERRED, check_micro_batches, defers_weight_grads
from partitioner.cost import task_costs, unit_seconds
from partitioner.machine import Machine
from partitioner.pipeline import cuts_of, stage_cuts, staged_units, step_graph
from partitioner.plan import build_plan
from partitioner.strategy import Unit, builtin

#: `--stages auto`
AUTO_STAGES = "auto"

#: how many pipelines, of least estimate, the commands' prediction is asked about
TOP = 3

#: the schedules tried where `--schedule` is not given: the micro-batches' weight gradients
#: each added in turn, or deferred to one task over them all (`legion_nn.micro_batches`)
AUTO_SCHEDULES = ("1f1b", "1f1b" + DEFERRED)

#: the steps the plan of a candidate's step graph is predicted to take (math.inf where it
#: does not fit): its bulk-synchronous sum, and its simulated step where the prediction
#: simulates it (None where it only sums it)
Predict = Callable[["PipelineChoice", TaskGraph], tuple[float, float | None]]
#: `Predict` of each candidate and its step graph, in order (the commands work them out on
#: every core at once)
PredictEach = Callable[
    [Sequence[tuple["PipelineChoice", TaskGraph]]], list[tuple[float, float | None]]
]


@dataclass(frozen=True)
class PipelineChoice:
    stages: int
    micro_batches: int
    #: the first layer of every stage after the first (`pipeline.stages_at`)
    cuts: tuple[str, ...]
    #: Σ stages + (M − 1) · heaviest, from the cost model's rows; 0 without stages
    estimate: float
    #: `predict`'s seconds; None where it was not asked
    predicted: float | None = None
    schedule: str = AUTO_SCHEDULES[0]
    #: how `predict` found them: "simulated", or "bulk-synchronous" where it sums the step
    #: (beyond the ranks whose steps `auto` simulates); None where it was not asked
    step_model: str | None = None

    @property
    def key(self) -> tuple:
        """What makes the step graph: stages, micro-batches, cuts and schedule."""
        return self.stages, self.micro_batches, self.cuts, self.schedule

    @property
    def label(self) -> str:
        return pipeline_label(self.stages, self.micro_batches, self.cuts, self.schedule)

    def row(self) -> dict:
        """As `partition --json` reports it, under `"pipeline_search"`."""
        return {
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "cuts": list(self.cuts),
            "schedule": self.schedule,
            "estimate_seconds": self.estimate,
            "predicted_seconds": self.predicted,
            "step_model": self.step_model,
        }


def pipeline_label(
    stages: int, micro_batches: int, cuts: Sequence[str], schedule: str = AUTO_SCHEDULES[0]
) -> str:
    """A step's stages, cuts and micro-batches as the commands print them: `2 stages cut before
    fc5, 4 micro-batches`, `no stages, 1 micro-batch`, and `, weight gradients deferred` under a
    `-deferred` schedule."""
    where = f"{stages} stages cut before {', '.join(cuts)}" if stages > 1 else "no stages"
    deferred = ", weight gradients deferred" if schedule.endswith(DEFERRED) and stages > 1 else ""
    return f"{where}, {micro_batches} micro-batch{'es' if micro_batches != 1 else ''}{deferred}"


@dataclass(frozen=True)
class PipelineSearch:
    chosen: PipelineChoice
    #: every candidate estimated, those predicted first, in the order tried
    tried: list[PipelineChoice]


def stage_counts(graph: TaskGraph, nranks: int) -> list[int]:
    """The stage counts `--stages auto` tries on `nranks` ranks: 1 and every divisor of
    `nranks` no larger than the layers and the batch."""
    most = min(len(staged_units(graph)), graph.batch, nranks)
    return [s for s in range(1, most + 1) if nranks % s == 0]


def micro_batch_counts(batch: int, stages: int, given: int | None) -> list[int]:
    """The micro-batch counts tried with `stages` stages: `given`, else S, 2·S and 4·S that a
    batch of `batch` samples holds (and 1 without stages)."""
    if given is not None:
        return [given]
    if stages == 1:
        return [1]
    return [m for m in (stages, 2 * stages, 4 * stages) if m <= batch]


def choose_pipeline(
    graph: TaskGraph,
    nranks: int,
    families: Sequence[str],
    machine: Machine,
    schedule: str | None,
    micro_batches: int | None,
    predict: Predict,
    simulates: Callable[[TaskGraph], bool] = lambda step: True,
    predict_each: PredictEach | None = None,
) -> PipelineSearch:
    """The stages, micro-batches, cuts and schedule (`schedule`, or where None the best of
    `AUTO_SCHEDULES`) of least predicted step for the unsplit step `graph` on `nranks` ranks,
    each stage's layers split by one of `families` (see the module docstring), and every
    candidate. `simulates` says whether `predict` simulates a step graph on every plan
    `auto` could give it, rather than sum it: a sum tries one schedule. The candidates are
    compared by their simulated steps where `predict` gives every one of them one (each
    pipeline then under every schedule), else by their sums. `predict_each` predicts the
    candidates tried all at once, each as `predict` would (default: one after another by
    `predict`)."""
    schedules = [schedule] if schedule is not None else list(AUTO_SCHEDULES)
    if schedule is None and not defers_weight_grads(graph):
        schedules = schedules[:1]  # the same step under each
    for name in schedules:
        check_micro_batches(1 if micro_batches is None else micro_batches, graph.batch, name)
    units = staged_units(graph)
    crossing = _crossing_bytes(graph, units)
    estimates: list[PipelineChoice] = []
    for stages in stage_counts(graph, nranks)[1:]:
        seconds = _layer_seconds(graph, units, nranks // stages, families, machine)
        alpha, beta = machine.link(0, nranks // stages)
        for count in micro_batch_counts(graph.batch, stages, micro_batches):
            work = [s / count for s in seconds]
            boundary = [2 * (alpha + b / count * beta) for b in crossing]
            of_unit = stage_cuts(graph, stages, work, boundary)
            loads = [0.0] * stages
            for unit, w in zip(units, work, strict=True):
                loads[of_unit[unit.name]] += w
            estimate = sum(loads) + (count - 1) * max(loads)
            estimates.append(
                PipelineChoice(stages, count, cuts_of(of_unit), estimate, schedule=schedules[0])
            )
    estimates.sort(key=lambda c: c.estimate)
    unstaged = PipelineChoice(1, micro_batches or 1, (), 0.0, schedule=schedules[0])
    shapes = (unstaged, *estimates[:TOP])
    trying: list[tuple[PipelineChoice, TaskGraph]] = []
    for shape in shapes:
        for name in schedules if shape.stages > 1 else schedules[:1]:
            trying.append(_under(graph, shape, name))
            if not simulates(trying[-1][1]):
                break

    def predicted_of(some: Sequence[tuple[PipelineChoice, TaskGraph]]):
        if predict_each is None:
            return [predict(candidate, step) for candidate, step in some]
        return predict_each(some)

    predicted = predicted_of(trying)
    # compared by their simulated steps where every one has one, else all by their sums: a
    # pipeline's sum counts its stages one after another (vgg19's 4 stages of data parallelism
    # on 1024 ranks: 9.53 s summed, 3.39 s simulated)
    every = all(simulated is not None for _, simulated in predicted)
    if every and len(schedules) > 1:  # simulated where `simulates` could not tell: each schedule
        tried_keys = {c.key for c, _ in trying}
        more = [
            _under(graph, shape, name)
            for shape in shapes
            if shape.stages > 1
            for name in schedules[1:]
            if replace(shape, schedule=name).key not in tried_keys
        ]
        if more:
            trying += more
            predicted += predicted_of(more)
            every = all(simulated is not None for _, simulated in predicted)
    model = "simulated" if every else "bulk-synchronous"
    tried = [
        replace(c, predicted=simulated if every else summed, step_model=model)
        for (c, _), (summed, simulated) in zip(trying, predicted, strict=True)
    ]
    best = min(tried, key=lambda c: (c.predicted, c.stages))
    return PipelineSearch(best, tried + estimates[TOP:])


def _under(
    graph: TaskGraph, shape: PipelineChoice, schedule: str
) -> tuple[PipelineChoice, TaskGraph]:
    """`shape` under `schedule`, and its step graph."""
    candidate = replace(shape, schedule=schedule)
    step = step_graph(graph, candidate.stages, candidate.micro_batches, schedule, candidate.cuts)
    return candidate, step


def _layer_seconds(
    graph: TaskGraph, units: list[Unit], share: int, families: Sequence[str], machine: Machine
) -> list[float]:
    """Each of the staged `units`' seconds on `share` ranks, under its cheapest of `families`
    (the cost model's rows of the unsplit step)."""
    best = [math.inf] * len(units)
    for family in families:
        plan = build_plan(graph, builtin(graph, family, share), share)
        rows = unit_seconds(task_costs(graph, plan, machine))
        for i, unit in enumerate(units):
            best[i] = min(best[i], rows.get(unit.name, 0.0))
    return best


def _crossing_bytes(graph: TaskGraph, units: list[Unit]) -> list[float]:
    """Bytes of the activations a cut before each of the staged `units` (index 0 … count)
    would carry from one stage to the next: those written by a unit before the cut and read
    after it."""
    index = {}
    for i, unit in enumerate(units):
        for name in unit.forward:
            index[name] = i
    written: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for name, i in index.items():
        for req in graph.task(name).requirements:
            tensor = graph.tensors[req.tensor]
            if tensor.kind != "activation":
                continue
            if req.write_rect is not None:
                written.setdefault(req.tensor, i)
            if req.read_rect is not None:
                last_read[req.tensor] = max(last_read.get(req.tensor, i), i)
    out = [0.0] * (len(units) + 1)
    for tensor, first in written.items():
        for cut in range(first + 1, last_read.get(tensor, first) + 1):
            out[cut] += graph.tensors[tensor].nbytes
    return out
