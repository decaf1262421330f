"""Every rank's program of a step, as `build_programs` gives them: the ranks' builders told each
task once (`task_events.each_task_event`), one rank built per class of ranks told alike
(`rank_classes`), the others' programs moved from it when asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.plan import Plan
from runtime.step.class_bound import fewest_classes
from runtime.step.rank_classes import SHARED_AT_MOST, rank_classes
from runtime.step.rank_program import RankProgram
from runtime.step.shared_programs import BuiltPrograms, SharedPrograms
from runtime.step.task_events import TaskEvents, build_each, each_task_event, step_messages
from runtime.step.update_fusion import fuse_into_gradients


def build_programs(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    ranks: Iterable[int],
    include: Iterable[str] | None = None,
    fuse_updates: bool = True,
    share: bool = True,
    most_built: int | None = None,
) -> Mapping[int, RankProgram] | None:
    """The programs of `ranks` for the tasks named in `include` (default: the whole step);
    `fuse_updates` lets a kernel that computes a gradient take the optimizer's step itself
    where nothing else reads the gradient (`runtime.step.update_fusion`); without it every gradient
    is stored, to read after the step. With `share`, ranks told the same things up to where
    their rects lie are built once and the others' programs moved there
    (`runtime.step.rank_classes`): the same programs, built faster.

    `most_built`: None where building them would take more than this many (rank, task) pairs
    built, found as soon as the ranks fall into too many classes (a data-parallel step of
    DenseNet-121 on 64 ranks builds 2 of them; a mixture of grids per layer on 1024 ranks, whose
    ranks all differ, gives up at its first uneven split, having made that far)."""
    ranks = list(ranks)
    tasks = len(graph.tasks) if include is None else len(set(include))
    stream = each_task_event(graph, plan, machine, ranks, include)
    every = most_built is None or len(ranks) * tasks <= most_built
    most = int(SHARED_AT_MOST * len(ranks))
    if not every:
        most = min(most, most_built // max(tasks, 1))
    events: list[TaskEvents] = []
    classes = None
    if share and len(ranks) > 2:
        if include is None:
            included = None
        else:
            wanted = set(include)
            included = [i for i, task in enumerate(graph.tasks) if task.name in wanted]
        if fewest_classes(plan, ranks, included) <= most:  # else told apart past `most`
            classes = rank_classes(plan, _kept(stream, events), ranks, most)
    if classes is None and not every:
        return None
    events += stream  # what telling the ranks apart left unread
    if classes is None:
        for event in events:
            event.mine.make_every_rank()
    built = build_each(
        graph, plan, events, step_messages(events), list(classes.members) if classes else ranks
    )
    if fuse_updates:
        for program in built.values():
            fuse_into_gradients(graph, program)
    if classes:
        return SharedPrograms(built, classes, events, ranks)
    return BuiltPrograms(built, events)


def ranks_all_differ(plan: Plan, ranks: Sequence[int]) -> bool:
    """Whether `build_programs` builds every one of `ranks`' own program: they fall into more
    classes than it shares (`SHARED_AT_MOST` of them), found from the plan's arrays
    (`fewest_classes`) before any is told apart."""
    return len(ranks) > 2 and fewest_classes(plan, ranks) > int(SHARED_AT_MOST * len(ranks))


def _kept(stream: Iterator[TaskEvents], into: list[TaskEvents]) -> Iterator[TaskEvents]:
    """`stream`'s events, each kept in `into` as it is read."""
    for event in stream:
        into.append(event)
        yield event
