"""What the builders of some ranks are told (`runtime.step.task_events`): only the messages with
an end among them, numbered as for every rank, and programs built from those equal to the same
ranks' programs built among all."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from legion_nn.networks import load_network
from legion_nn.sources import load_source_graph
from partitioner.machine import Machine
from partitioner.pipeline import pipelined
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.step.rank_messages import STEP_START
from runtime.step.task_events import build_each, task_events
from tests.paths import FIXTURES

MACHINE = Machine(link_gbytes_per_s=0.5, latency_us=20.0)


def test_ranks_built_apart_are_told_only_the_messages_with_an_end_among_them():
    """A model-parallel step sends each rank's slice of a layer's output to every other rank:
    ranks 2 and 5, built apart, are told each message with an end at either of them (and no
    other), with the same sequence numbers as when every rank is built, and build the programs
    they are built among all."""
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, "model", 8), 8)
    everyone = list(range(8))
    every_event, count = task_events(graph, plan, MACHINE, everyone)
    some = [2, 5]
    some_events, some_count = task_events(graph, plan, MACHINE, some)
    assert some_count == count
    fan_outs = 0
    for full, apart in zip(every_event, some_events, strict=True):
        ends = [m for m in full.messages if m.src in some or m.dst in some]
        assert apart.messages == ends, full.task.name
        fan_outs += sum(m.src not in some and m.dst not in some for m in full.messages)
    assert fan_outs  # there were messages elsewhere to leave out
    alone = build_each(graph, plan, some_events, some_count, some)
    among_all = build_each(graph, plan, every_event, count, everyone)
    for rank in some:  # each told its own collective objects: compared by sequence number
        assert _by_seq(alone[rank].tasks) == _by_seq(among_all[rank].tasks)
        assert alone[rank].post_at_start == among_all[rank].post_at_start
        assert alone[rank].boxes == among_all[rank].boxes


def _by_seq(tasks):
    return [replace(rt, collectives=[c.seq for c in rt.collectives]) for rt in tasks]


#: (network, batch, strategy, ranks, stages): plans with halos, fan-outs, partial sums, sharded
#: homes' parts and micro-batches in stages
TOLD_CASES = [
    ("seed-lcn-small", 8, "spatial", 8, 1),
    ("seed-lcn-small", 8, "model", 6, 1),
    (str(FIXTURES / "residual_small.json"), 8, "spatial", 6, 1),
    ("deep-mlp", 16, "model", 8, 2),
]


@pytest.mark.parametrize("network, batch, strategy, ranks, stages", TOLD_CASES)
def test_the_messages_told_are_every_ranks_with_an_end_among_those_built(
    network, batch, strategy, ranks, stages
):
    """Whatever ranks are built, they are told the messages of the step with an end among
    them, in order, numbered as when every rank is built, and the step's message count."""
    graph = load_source_graph(network, batch, batch)
    if stages > 1:
        graph, _ = pipelined(graph, stages, 2 * stages)
    plan = build_plan(graph, builtin(graph, strategy, ranks), ranks)
    every_event, count = task_events(graph, plan, MACHINE, range(ranks))
    seq = 0
    for event in every_event:  # every rank built: one message per transfer and destination
        transfers = plan.tasks[graph.tasks.index(event.task)].transfers
        expected = [
            (t.tensor, t.rect, t.src, dst, t.nbytes, event.position, t.reduce)
            for t in transfers
            for dst in t.dsts
        ]
        assert [(*m[1:7], m.reduce) for m in event.messages] == expected, event.task.name
        assert [m.seq for m in event.messages] == list(range(seq, seq + len(expected)))
        seq = event.next_seq
    rng = np.random.default_rng(ranks)
    for size in (1, ranks // 2, ranks - 1):
        some = sorted(rng.choice(ranks, size, replace=False).tolist())
        events, told_count = task_events(graph, plan, MACHINE, some)
        assert told_count == count
        for full, apart in zip(every_event, events, strict=True):
            ends = [m for m in full.messages if m.src in some or m.dst in some]
            assert apart.messages == ends, (some, full.task.name)


@pytest.mark.parametrize("network, batch, strategy, ranks, stages", TOLD_CASES)
def test_each_rank_files_its_ends_of_each_message_as_the_builder_states(
    network, batch, strategy, ranks, stages
):
    """The ends grouped per rank (`TaskEvents.told`) are each built rank's ends filed message by
    message, in sequence order: the partial sums it sends and receives, the copies it receives,
    every copy it is an end of under the task after which it is posted, the bytes it sends,
    and a box per tensor holding every rect it receives; and each program's lists are those.
    Asked for some of the ranks told, they are those ranks' alone."""
    graph = load_source_graph(network, batch, batch)
    if stages > 1:
        graph, _ = pipelined(graph, stages, 2 * stages)
    plan = build_plan(graph, builtin(graph, strategy, ranks), ranks)
    some = list(range(0, ranks, 2))
    events, count = task_events(graph, plan, MACHINE, some)
    programs = build_each(graph, plan, events, count, some)
    every, fewer = np.isin(np.arange(ranks), some), np.isin(np.arange(ranks), some[::2])
    posted = {rank: {} for rank in some}
    for event in events:
        told = event.told.of_ranks(every)
        told_fewer = event.told.of_ranks(fewer)
        assert set(told_fewer) == {rank for rank in told if fewer[rank]}
        for rank, found in told_fewer.items():
            assert (found.partial_out, found.partial_in, found.copies_in, found.posted) == (
                told[rank].partial_out, told[rank].partial_in, told[rank].copies_in,
                told[rank].posted,
            )  # fmt: skip
            assert (found.sent_bytes, found.received) == (
                told[rank].sent_bytes,
                told[rank].received,
            )
        for rank in some:
            mine = [m for m in event.messages if rank in (m.src, m.dst)]
            found = told.get(rank)
            assert (found is None) == (not mine), (rank, event.task.name)
            if found is None:
                continue
            assert found.partial_out == [m for m in mine if m.reduce and m.src == rank]
            assert found.partial_in == [m for m in mine if m.reduce and m.dst == rank]
            assert found.copies_in == [m for m in mine if not m.reduce and m.dst == rank]
            copies = [m for m in mine if not m.reduce]
            assert [m for _, run in found.posted for m in run] == sorted(
                copies, key=lambda m: (m.post_after, m.seq)
            )
            assert all(m.post_after == at for at, run in found.posted for m in run)
            assert found.sent_bytes == sum(m.nbytes for m in mine if m.src == rank)
            for m in mine:
                if m.dst == rank and not m.rect.is_empty():
                    boxes = [box for t, box, _ in found.received if t == m.tensor]
                    assert any(box.contains(m.rect) for box in boxes), (rank, m)
            rt = programs[rank].tasks[event.position]
            assert (rt.partial_out, rt.partial_in, rt.copies_in) == (
                found.partial_out,
                found.partial_in,
                found.copies_in,
            )
            for m in copies:
                posted[rank].setdefault(m.post_after, []).append(m)
    for rank, program in programs.items():
        by_point = {at: list(rt.post) for at, rt in enumerate(program.tasks) if rt.post}
        if program.post_at_start:
            by_point[STEP_START] = program.post_at_start
        assert by_point == posted[rank], rank
