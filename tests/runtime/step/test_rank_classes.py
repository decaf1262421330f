"""Ranks built once per class (`runtime.step.rank_classes`): the programs moved from a class's first
rank equal, field for field, the programs built rank by rank, on every kind of plan; and ranks
that are alike do share a build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from legion_nn.networks import load_network
from legion_nn.sources import load_source_graph
from partitioner.machine import Machine
from partitioner.pipeline import pipelined
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.strategy import builtin, from_grids
from runtime.step import programs as programs_module
from runtime.step import task_events as task_events_module
from runtime.step.class_bound import fewest_classes
from runtime.step.compiled import flatten
from runtime.step.links import Links
from runtime.step.prediction import predict_step, simulate_compiled
from runtime.step.programs import build_programs
from runtime.step.rank_builder import Builder
from runtime.step.rank_classes import rank_classes
from runtime.step.rank_cpu import cpu_slowdown
from runtime.step.rank_memory import predict
from runtime.step.rank_parts import has_part
from runtime.step.shared_programs import SharedPrograms
from runtime.step.simulator import simulate_step
from runtime.step.task_events import build_each, each_task_event, task_events
from runtime.step.update_fusion import fuse_into_gradients
from tests.paths import FIXTURES, ROOT

MACHINE = Machine(link_gbytes_per_s=0.5, latency_us=20.0)

#: (network, batch, strategies, homes, rank counts)
CASES = [
    ("seed-lcn-small", 16, ("data", "model", "spatial", "auto"), ("replicated", "sharded"), (4, 16)),
    ("seed-lcn", 16, ("data", "spatial"), ("replicated",), (16,)),
    (str(ROOT / "examples" / "megatron-mlp.json"), 8, ("data", "model", "auto"), ("sharded",), (8,)),
    (str(FIXTURES / "residual_small.json"), 8, ("data", "model", "spatial"),
     ("replicated", "sharded"), (6,)),
    (str(FIXTURES / "digits_cnn.onnx"), 8, ("data", "spatial"), ("replicated",),
     (8,)),
]  # fmt: skip


def _cases():
    for network, batch, strategies, homes, counts in CASES:
        for strategy in strategies:
            for home in homes:
                for ranks in counts:
                    label = f"{Path(network).stem}-{strategy}-{home}-{ranks}"
                    yield pytest.param(network, batch, strategy, home, ranks, id=label)


def _programs(graph, plan, ranks: int, fused: bool):
    """Every rank's programs built rank by rank and built once per class (each class's first
    rank's fused, where `fused`, before the others' are moved from it), from one set of task
    events (so that both hold the same collective objects)."""
    everyone = list(range(ranks))
    events, messages = task_events(graph, plan, MACHINE, everyone)
    alone = build_each(graph, plan, events, messages, everyone)
    classes = rank_classes(plan, events, everyone, most=len(everyone))
    built = build_each(graph, plan, events, messages, list(classes.members))
    if fused:
        for program in (*alone.values(), *built.values()):
            fuse_into_gradients(graph, program)
    return alone, dict(SharedPrograms(built, classes, events, everyone)), classes


def _equal(alone, shared):
    assert list(alone) == list(shared)
    for rank, program in alone.items():
        moved = shared[rank]
        assert moved.post_at_start == program.post_at_start, rank
        assert moved.boxes == program.boxes, rank
        assert (moved.bytes_planned, moved.messages) == (program.bytes_planned, program.messages)
        for built, derived in zip(program.tasks, moved.tasks, strict=True):
            assert derived == built, (rank, built.task.name)
            assert derived.tensors == built.tensors, (rank, built.task.name)


@pytest.mark.parametrize("network, batch, strategy, home, ranks", list(_cases()))
def test_programs_moved_within_a_class_are_the_programs_built(
    network, batch, strategy, home, ranks
):
    graph = load_source_graph(network, batch, batch)
    chosen, _ = resolve_strategy(graph, strategy, ranks, MACHINE, 5.0, None, home)
    plan = build_plan(graph, chosen, ranks)
    for fused in (False, True):
        alone, shared, classes = _programs(graph, plan, ranks, fused)
        _equal(alone, shared)
    assert fewest_classes(plan, range(ranks)) <= len(classes.members)
    odd = list(range(1, ranks, 2))
    some = range(0, len(graph.tasks), 3)
    events, _ = task_events(graph, plan, MACHINE, odd, [graph.tasks[i].name for i in some])
    told = rank_classes(plan, events, odd, most=len(odd))
    assert fewest_classes(plan, odd, some) <= len(told.members)


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_programs_of_micro_batches_in_stages_moved_within_a_class_are_the_programs_built(strategy):
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), 2, 4)
    plan = build_plan(graph, builtin(graph, strategy, 8), 8)
    alone, shared, _ = _programs(graph, plan, 8, True)
    _equal(alone, shared)


def test_ranks_alike_share_a_build():
    """Data parallelism on 16 ranks: rank 0 holds the loss, and the others are alike, though
    they send and add different shares of the rings (a gradient of n elements cut into 16
    chunks of ⌊n/16⌋ and ⌈n/16⌉), which their builders only add up."""
    graph = load_source_graph("seed-lcn", 32, 32)
    chosen, _ = resolve_strategy(graph, "data", 16, MACHINE, 5.0, None, "replicated")
    plan = build_plan(graph, chosen, 16)
    _, shared, classes = _programs(graph, plan, 16, False)
    assert {rank: len(members) for rank, members in classes.members.items()} == {0: 1, 1: 15}
    assert len({shared[rank].bytes_planned for rank in range(1, 16)}) > 1  # the rings' shares


def test_telling_ranks_apart_stops_reading_events_once_they_are_too_many():
    """The ranks of a model-parallel step all differ: allowed 2 classes, telling them apart
    gives up within the step's first tasks, having made no more of its events, and a budget
    of built (rank, task) pairs below every rank's gives no programs; a data-parallel step's
    ranks fall into 2 classes, within the same budget."""
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    model = build_plan(graph, builtin(graph, "model", 8), 8)
    made = []

    def counted(events):
        for event in events:
            made.append(event.position)
            yield event

    stream = each_task_event(graph, model, MACHINE, range(8))
    assert rank_classes(model, counted(stream), list(range(8)), most=2) is None
    assert 0 < len(made) < len(graph.tasks) // 2
    budget = 3 * len(graph.tasks)
    assert build_programs(graph, model, MACHINE, range(8), most_built=budget) is None
    data = build_plan(graph, builtin(graph, "data", 8), 8)
    shared = build_programs(graph, data, MACHINE, range(8), most_built=budget)
    assert len(shared.classes.members) == 2
    alone = build_programs(graph, data, MACHINE, range(8), share=False)
    assert [p.boxes for p in shared.values()] == [p.boxes for p in alone.values()]


def test_ranks_bound_to_too_many_classes_are_not_told_apart(monkeypatch):
    """The model-parallel step's 8 ranks differ in their pieces' shapes and their messages'
    bytes, which the plan's arrays give at once: within a budget that allows 2 classes, no
    events are made to tell them apart; a data-parallel step's bound allows its 2."""
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    model = build_plan(graph, builtin(graph, "model", 8), 8)
    data = build_plan(graph, builtin(graph, "data", 8), 8)
    assert fewest_classes(model, range(8)) > 2
    assert fewest_classes(data, range(8)) <= 2
    budget = 2 * len(graph.tasks)
    told = []
    real = programs_module.rank_classes
    monkeypatch.setattr(
        programs_module, "rank_classes", lambda *args: told.append(args) or real(*args)
    )
    assert build_programs(graph, model, MACHINE, range(8), most_built=budget) is None
    assert told == []
    assert (
        len(build_programs(graph, data, MACHINE, range(8), most_built=budget).classes.members) == 2
    )
    assert len(told) == 1


def test_build_programs_shares_by_default_and_gives_the_same_step():
    graph = load_source_graph("seed-lcn-small", 16, 16)
    chosen, _ = resolve_strategy(graph, "data", 8, MACHINE, 5.0, None, "replicated")
    plan = build_plan(graph, chosen, 8)
    shared = build_programs(graph, plan, MACHINE, range(8))
    alone = build_programs(graph, plan, MACHINE, range(8), share=False)
    assert [p.boxes for p in shared.values()] == [p.boxes for p in alone.values()]
    assert [p.bytes_planned for p in shared.values()] == [p.bytes_planned for p in alone.values()]


@pytest.mark.parametrize(
    ("network", "strategy", "home"),
    [("seed-lcn", "data", "replicated"), ("seed-lcn-small", "data", "sharded"),
     ("seed-lcn-small", "spatial", "replicated"), ("seed-lcn-small", "auto", "replicated")],
)  # fmt: skip
def test_a_step_and_its_memory_read_once_per_class_are_those_of_every_rank(network, strategy, home):
    """The compiled simulation and the memory model read a class's program once for all its
    ranks (`shared_programs.source`, `own_messages`): every rank's finish, wait and peak are those
    of the programs built rank by rank."""
    graph = load_source_graph(network, 16, 16)
    chosen, _ = resolve_strategy(graph, strategy, 16, MACHINE, 5.0, None, home)
    _assert_read_once_per_class_as_every_rank(graph, build_plan(graph, chosen, 16))


def _assert_read_once_per_class_as_every_rank(graph, plan):
    everyone = list(range(plan.nranks))
    events, messages = task_events(graph, plan, MACHINE, everyone)
    classes = rank_classes(plan, events, everyone, most=len(everyone))
    built = build_each(graph, plan, events, messages, list(classes.members))
    for program in built.values():
        fuse_into_gradients(graph, program)
    shared = SharedPrograms(built, classes, events, everyone)
    alone = build_programs(graph, plan, MACHINE, everyone, share=False)
    fast = predict_step(graph, plan, MACHINE, programs=shared, simulate=simulate_compiled)
    for exact in (
        predict_step(graph, plan, MACHINE, programs=alone, simulate=simulate_compiled),
        predict_step(graph, plan, MACHINE, programs=alone, simulate=simulate_step),
    ):
        assert (fast.finish, fast.waiting, fast.compute) == (
            exact.finish, exact.waiting, exact.compute
        )  # fmt: skip
    flat_shared, flat_alone = (_flat(graph, plan, p) for p in (shared, alone))
    assert flat_shared.heap_room == flat_alone.heap_room  # each post and wait counted once
    assert len(flat_shared.ops) == len(flat_alone.ops)
    assert flat_shared.op_ptr.tolist() == flat_alone.op_ptr.tolist()
    for rank, memory in predict(graph, plan, MACHINE, programs=shared).items():
        built = predict(graph, plan, MACHINE, [rank], programs=alone)[rank]
        assert memory.peak == built.peak, rank
        assert memory.breakdown() == built.breakdown(), rank


def _grouped_sums_plan():
    """seed-lcn-small on 8 ranks, data-parallel but for its classifier, cut 2 by batch and 4 by
    its input channels: each batch half's channel sums are a collective of its own."""
    graph = load_source_graph("seed-lcn-small", 16, 16)
    grids = dict(builtin(graph, "data", 8).unit_grids)
    grids["classifier.linear1"] = (2, 1, 1, 1, 4, 1, 1)
    return graph, build_plan(graph, from_grids(graph, grids, 8), 8)


def test_ranks_of_different_groups_collectives_share_a_class_and_their_programs_are_built():
    """A rank's part in the collectives it joins is told in order, not which of a task's it
    joins: ranks 1 and 5, at the same place of the two batch halves' channel sums, are alike,
    and each moved program joins its own half's collective."""
    graph, plan = _grouped_sums_plan()
    assert any(len(task.reductions) > 1 for task in plan.tasks)  # the halves' own sums
    for fused in (False, True):
        alone, shared, classes = _programs(graph, plan, 8, fused)
        _equal(alone, shared)
    assert [1, 5] in classes.members.values()
    assert {c.seq for _, c in shared[5].collectives} != {c.seq for _, c in shared[1].collectives}
    _assert_read_once_per_class_as_every_rank(graph, plan)


def _flat(graph, plan, programs):
    """The compiled step's instructions for `programs`, as `simulate_compiled` makes them from
    the seconds `predict_step` gives each rank's tasks."""

    def flattened(programs, seconds, machine, passes):
        links = Links.of(machine, plan.nranks)
        return flatten(programs, seconds, links, passes, cpu_slowdown(machine, programs))

    return predict_step(graph, plan, MACHINE, programs=programs, simulate=flattened)


@pytest.mark.parametrize(("strategy", "home"), [("data", "replicated"), ("spatial", "sharded")])
def test_each_ranks_pieces_are_the_plans_in_its_order_made_lazily_or_at_once(strategy, home):
    """`PiecesByRank` gives each rank the pieces of the task it computes, in the plan's order,
    each rank once however many of a piece's ranks it is: piece by piece as asked for, or every
    rank's at once."""
    graph = load_source_graph("seed-lcn-small", 16, 16)
    chosen, _ = resolve_strategy(graph, strategy, 4, MACHINE, 5.0, None, home)
    plan = build_plan(graph, chosen, 4)
    lazy, _ = task_events(graph, plan, MACHINE, range(4))
    at_once, _ = task_events(graph, plan, MACHINE, range(4))
    index = {task.name: i for i, task in enumerate(graph.tasks)}
    replicated = 0
    for one, other in zip(lazy, at_once, strict=True):
        task_plan = plan.tasks[index[one.task.name]]
        other.mine.make_every_rank()
        for rank in range(4):
            want = [p for p in task_plan.pieces if rank in p.ranks]
            replicated += sum(len(p.ranks) > 1 for p in want)
            assert list(one.mine.get(rank, [])) == want == list(other.mine.get(rank, []))
        assert one.mine.get(7) == () == other.mine.get(7, ())  # not built
    if home == "replicated":
        assert replicated  # the updates of parameters every rank holds: run by every rank


@pytest.mark.parametrize(
    "network, batch, strategy, home, ranks",
    [
        (str(FIXTURES / "narrowing.json"), 8, "model", "replicated", 16),
        (str(FIXTURES / "narrowing.json"), 8, "model", "sharded", 16),
        ("seed-lcn-small", 16, "model", "sharded", 16),
        (str(FIXTURES / "residual_small.json"), 8, "auto", "replicated", 6),
        (str(ROOT / "examples" / "megatron-mlp.json"), 8, "auto", "sharded", 8),
    ],
)
def test_tasks_a_rank_has_no_part_in_told_at_once_build_the_programs_told_task_by_task(
    network, batch, strategy, home, ranks, monkeypatch
):
    """A rank's tasks it has no part in (`rank_parts.has_part`), told at once (`Builder.idle`), leave
    its program, fused or not, as telling it every task's pieces, messages and collectives
    does; on plans where some ranks have a part in no task at all (`rank_parts.idle_ranks`), and
    others' tasks are partly idle."""
    graph = load_source_graph(network, batch, batch)
    chosen, _ = resolve_strategy(graph, strategy, ranks, MACHINE, 5.0, None, home)
    plan = build_plan(graph, chosen, ranks)
    assert not has_part(plan).all()
    everyone = list(range(ranks))
    events, messages = task_events(graph, plan, MACHINE, everyone)
    at_once = build_each(graph, plan, events, messages, everyone)
    monkeypatch.setattr(
        task_events_module, "has_part", lambda p: np.ones((len(p.tasks), ranks), bool)
    )
    task_by_task = build_each(graph, plan, events, messages, everyone)
    for program in (*at_once.values(), *task_by_task.values()):
        fuse_into_gradients(graph, program)
    _equal(task_by_task, at_once)


def test_a_task_told_at_once_leaves_the_builder_as_telling_it_does():
    """At every task a rank has no part in (`rank_parts.has_part`), on plans with ranks idle all step
    and ranks idle in some tasks, `Builder.idle` leaves the builder as `begin` and `end`
    would: the same task, layouts and zeroings (a rank holding nothing of a tensor opened for
    writing has zeroed none of it)."""
    import copy

    for network, batch, strategy, home, ranks in [
        (str(FIXTURES / "narrowing.json"), 8, "model", "sharded", 16),
        ("seed-lcn-small", 16, "model", "replicated", 16),
        ("seed-lcn-small", 16, "spatial", "sharded", 16),
    ]:
        graph = load_source_graph(network, batch, batch)
        chosen, _ = resolve_strategy(graph, strategy, ranks, MACHINE, 5.0, None, home)
        plan = build_plan(graph, chosen, ranks)
        index = {task.name: i for i, task in enumerate(graph.tasks)}
        events, _ = task_events(graph, plan, MACHINE, range(ranks))
        idle_told = 0
        for rank in range(ranks):
            builder = Builder(graph, plan, rank)
            for event in events:
                if has_part(plan)[index[event.task.name], rank]:
                    builder.begin(event.position, event.task, event.mine.get(rank, ()))
                    told = event.told.of_ranks(np.arange(ranks) == rank) if event.messages else {}
                    if rank in told:
                        builder.messages(told[rank])
                    for collective, sent, start in event.collectives:
                        if rank in collective.reduction.participants:
                            builder.collective(collective, sent.get(rank, 0), start)
                    builder.end(event.holdings, event.deferred)
                    continue
                told_at_once = copy.copy(builder)
                told_at_once.tasks, told_at_once.layouts = (
                    list(builder.tasks),
                    dict(builder.layouts),
                )
                told_at_once.zeroed = copy.deepcopy(builder.zeroed)
                told_at_once.idle(event.position, event.task, event.holdings)
                builder.begin(event.position, event.task, ())
                builder.end(event.holdings, event.deferred)
                assert told_at_once.tasks == builder.tasks
                assert told_at_once.layouts == builder.layouts
                zeroed = {t: rects for t, rects in builder.zeroed.items() if rects}
                assert {t: r for t, r in told_at_once.zeroed.items() if r} == zeroed
                assert told_at_once.zeroed_at == builder.zeroed_at
                idle_told += 1
        assert idle_told
