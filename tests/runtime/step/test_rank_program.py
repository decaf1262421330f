"""Where a rank program completes its collectives (`rank_builder.Builder._completion_points`):
each at the first point that needs its sum, whatever started before it."""

from __future__ import annotations

import numpy as np
import pytest

from legion_nn.networks import load_network
from legion_nn.sources import load_source_graph
from partitioner.boxes import grid_shape
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, with_homes
from runtime.step.last_writes import LastWrites
from runtime.step.order import step_order
from runtime.step.programs import build_programs
from runtime.step.rank_messages import STEP_START
from runtime.step.rank_program import RankProgram
from tests.paths import FIXTURES


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


def _last_writer(grid, cuts, lo, hi) -> int:
    """The position `LastWrites.positions` gives one rect, cell by cell: the latest over the
    cells whose intervals meet the rect's in every dim."""
    if any(a >= b for a, b in zip(lo, hi)):
        return STEP_START
    found = STEP_START
    for cell in np.ndindex(grid.shape):
        if all(c[i] < b and c[i + 1] > a for c, i, a, b in zip(cuts, cell, lo, hi)):
            found = max(found, int(grid[cell]))
    return found


@pytest.mark.parametrize(
    ("network", "strategy"),
    [("seed-lcn-small", "spatial"), ("seed-lcn-small", "model"), ("residual", "spatial")],
)
def test_a_copy_is_posted_after_the_last_writer_of_the_cells_it_meets(network, strategy):
    """`LastWrites.positions` (each copy's post point) equals the latest writer over the cells
    its rect meets, found cell by cell: for every rect of the plan's transfers, rects wider than
    a cell, a rect shifted to span cut points, and empty rects."""
    if network == "residual":
        graph = load_source_graph(str(FIXTURES / "residual_small.json"), 6, 6)
    else:
        graph = load_network(network).lower(batch=6)
    plan = build_plan(graph, builtin(graph, strategy, 3), 3)
    order = step_order(graph)
    last = LastWrites(len(graph.tasks), order)
    seen = 0
    for position, index in enumerate(order):
        for block in plan.tasks[index].transfer_set.blocks:
            if block.reduce or not len(block):
                continue
            lo, hi = block.lo.astype(np.int64), block.hi.astype(np.int64)
            span = np.maximum(hi - lo, 1)
            rects = [(lo, hi), (lo - span // 2, hi + span // 2), (hi, hi), (lo, lo + 1)]
            for a, b in rects:
                got = last.positions(block.tensor, a, b)
                written = last._written.get(block.tensor)
                for i in range(len(a)):
                    if written is None:
                        want = STEP_START
                    else:
                        layout, writers = written
                        grid = last._position[writers].reshape(grid_shape(layout.cut_arrays))
                        want = _last_writer(grid, layout.cut_arrays, a[i], b[i])
                    assert got[i] == want
                    seen += want != STEP_START
        for tensor, layout in plan.tasks[index].holdings.items():
            last.record(tensor, layout, plan.written_by[index][tensor])
        assert position == last._position[index]
    assert seen  # copies after a writer in this step were met


def test_the_last_writer_of_rects_over_cells_of_many_writers():
    """`LastWrites.positions` over layouts whose cells were last written by different tasks
    (some out of view), for rects within a cell, across cells, past the tensor and empty: the
    latest writer in view over the cells each meets, cell by cell."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        ndim = int(rng.integers(1, 4))
        cuts = [np.unique(np.r_[0, rng.integers(1, 12, 3), 12]) for _ in range(ndim)]
        cells = int(np.prod([len(c) - 1 for c in cuts]))
        layout = Layout([c.tolist() for c in cuts], {i: (0,) for i in range(cells)})
        ntasks = 6
        last = LastWrites(ntasks, [4, 0, 2, 5])  # tasks 1 and 3 out of view
        last.record("t", layout, rng.integers(-1, ntasks, cells))
        lo = rng.integers(-2, 13, (40, ndim))
        hi = lo + rng.integers(-1, 8, (40, ndim))
        got = last.positions("t", lo, hi)
        grid = last._position[last._written["t"][1]].reshape(grid_shape(cuts))
        want = [_last_writer(grid, cuts, a, b) for a, b in zip(lo, hi)]
        assert got.tolist() == want
    assert last.positions("unwritten", lo, hi).tolist() == [STEP_START] * len(lo)
