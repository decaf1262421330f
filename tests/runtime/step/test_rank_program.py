"""Where a rank program completes its collectives (`Builder._completion_points`): each at the
first point that needs its sum, whatever started before it."""

from __future__ import annotations

import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, with_homes
from runtime.step.programs import build_programs
from runtime.step.rank_program import RankProgram


def first_need(program: RankProgram, start: int, ordinal: int) -> tuple[int, str] | None:
    """The first point after `program`'s collective `ordinal` starts (at task `start`) that needs
    its sum, worked out from the rule's statement: before the next task of a sharded home's
    reduce-scatter; before a task that touches its tensor; after a task that posts a copy of
    its tensor from this rank."""
    collective = program.collectives[ordinal][1]
    tensor = collective.reduction.tensor
    for rt in program.tasks[start:]:
        if rt.index > start and (tensor in rt.tensors or collective.sharded):
            return rt.index, "before"
        if any(m.tensor == tensor and m.src == program.rank for m in rt.post):
            return rt.index, "after"
    return None


CASES = [
    ("seed-lcn-small", "data", 4, "replicated"),
    ("seed-lcn-small", "spatial", 4, "replicated"),
    ("seed-lcn-small", "model", 3, "replicated"),
    ("seed-lcn-small", "data", 4, "sharded"),
    ("deep-mlp", "model", 4, "replicated"),
]


@pytest.mark.parametrize(("network", "strategy", "nranks", "homes"), CASES)
def test_each_collective_completes_at_the_first_point_that_needs_its_sum(
    network, strategy, nranks, homes
):
    graph = load_network(network).lower(batch=8)
    chosen = builtin(graph, strategy, nranks)
    if homes == "sharded":
        chosen = with_homes(graph, chosen, homes)
    plan = build_plan(graph, chosen, nranks)
    programs = build_programs(graph, plan, Machine(), range(nranks))
    out_of_order = 0
    for program in programs.values():
        points: dict[int, tuple[int, str]] = {}
        for rt in program.tasks:
            for where, ordinals in (("before", rt.complete_before), ("after", rt.complete_after)):
                assert list(ordinals) == sorted(set(ordinals))  # in start order, each once
                for ordinal in ordinals:
                    assert ordinal not in points  # completed once
                    points[ordinal] = (rt.index, where)
        for ordinal, (start, _) in enumerate(program.collectives):
            assert points.get(ordinal) == first_need(program, start, ordinal)
        last = len(program.tasks) - 1
        collectives = range(len(program.collectives))
        assert program.completions == [points.get(o, (last, ""))[0] for o in collectives]
        out_of_order += program.completions != sorted(program.completions)
    # the rule is not start order: somewhere a later sum is needed first
    assert out_of_order
