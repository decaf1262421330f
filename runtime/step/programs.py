"""Every rank's program of a step, as `build_programs` gives them: the ranks' builders told each
task once (`task_events.task_events`), one rank built per class of ranks told alike
(`rank_classes`), the others' programs moved from it when asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.plan import Plan
from runtime.step.rank_classes import SharedPrograms, rank_classes
from runtime.step.rank_program import RankProgram
from runtime.step.task_events import build_each, task_events
from runtime.step.update_fusion import fuse_into_gradients


def build_programs(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    ranks: Iterable[int],
    include: Iterable[str] | None = None,
    fuse_updates: bool = True,
    share: bool = True,
) -> Mapping[int, RankProgram]:
    """The programs of `ranks` for the tasks named in `include` (default: the whole step);
    `fuse_updates` lets a kernel that computes a gradient take the optimizer's step itself
    where nothing else reads the gradient (`runtime.step.update_fusion`); without it every gradient
    is stored, to read after the step. With `share`, ranks told the same things up to where
    their rects lie are built once and the others' programs moved there
    (`runtime.step.rank_classes`): the same programs, built faster."""
    ranks = list(ranks)
    events, messages = task_events(graph, plan, machine, ranks, include)
    classes = rank_classes(plan, events, ranks) if share and len(ranks) > 2 else None
    if classes is None:
        for event in events:
            event.mine.make_every_rank()
    built = build_each(graph, plan, events, messages, list(classes.members) if classes else ranks)
    if fuse_updates:
        for program in built.values():
            fuse_into_gradients(graph, program)
    return SharedPrograms(built, classes, events, ranks) if classes else built
