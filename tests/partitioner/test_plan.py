"""Plans: hand-computed pieces, halos and reductions, and random networks through verify_plan."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import partitioner.verify_plan as verify_module
from legion_nn.errors import LegionNNError, VerifyError
from legion_nn.layers import Add, Evaluate, Filter, Linear, Softmax
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.rect import Rect
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import Transfer, build_plan
from partitioner.strategy import Strategy, builtin, factorizations, find_units, from_grids
from partitioner.task_plan import TaskPlan
from partitioner.transfers import TransferSet
from partitioner.verify_plan import PAIRWISE, verify_plan
from tests.plan_cases import networks


@pytest.fixture(scope="module")
def lcn():
    return load_network("seed-lcn").lower(batch=256)


def task_plan(plan, name):
    return next(t for t in plan.tasks if t.task == name)


def edit_transfers(plan, name, transfers):
    """Replace task `name`'s transfers (a plan's objects are read-only views of its arrays)."""
    index = next(i for i, t in enumerate(plan.tasks) if t.task == name)
    plan.tasks[index] = plan.tasks[index].with_transfers(transfers)


def test_halo_of_a_7x7_window_split_2x2_over_27x27(lcn):
    plan = build_plan(lcn, builtin(lcn, "spatial", 4), 4)
    conv = task_plan(plan, "L1.filter")
    # output rows 0..13 of 27 read input rows 0..19 of 33; the input is split 17 + 16
    assert conv.pieces[0].requirements[0].read_rect == Rect((0, 0, 0, 0), (256, 64, 20, 20))
    to_rank0 = sorted((t.src, t.rect, t.nbytes) for t in conv.transfers if t.dsts == (0,))
    assert to_rank0 == [
        (1, Rect((0, 0, 0, 17), (256, 64, 17, 20)), 256 * 64 * 17 * 3 * 4),
        (2, Rect((0, 0, 17, 0), (256, 64, 20, 17)), 256 * 64 * 3 * 17 * 4),
        (3, Rect((0, 0, 17, 17), (256, 64, 20, 20)), 256 * 64 * 3 * 3 * 4),
    ]
    # rank 3 (output rows and cols 14..26) reads input 14..32 and holds 17..32
    to_rank3 = sum(t.nbytes for t in conv.transfers if 3 in t.dsts)
    assert to_rank3 == 256 * 64 * (19 * 19 - 16 * 16) * 4
    # untied weights live with their output positions: no weight gradient crosses ranks
    grad = task_plan(plan, "L1.filter.grad")
    assert not [r for r in grad.reductions if r.tensor == "L1.W.grad"]
    assert not [t for t in grad.transfers if t.tensor == "L1.W.grad"]
    # the input gradient's halos come back as partial sums to their owners
    partial = [t for t in grad.transfers if t.reduce and t.dsts == (0,)]
    assert sorted(t.src for t in partial) == [1, 2, 3]
    verify_plan(lcn, plan)


def test_data_parallel_all_reduces_each_replicated_parameter(lcn):
    plan = build_plan(lcn, builtin(lcn, "data", 4), 4)
    grad = task_plan(plan, "L1.filter.grad")
    (reduction,) = [r for r in grad.reductions if r.tensor == "L1.W.grad"]
    assert reduction.algorithm == "allreduce"
    assert reduction.participants == (0, 1, 2, 3)
    assert reduction.nbytes == 64 * 64 * 7 * 7 * 27 * 27 * 4
    assert all(not t.transfers for t in plan.tasks)
    # the loss is reduced to its owner, rank 0
    (loss,) = task_plan(plan, "classifier.softmax").reductions
    assert (loss.algorithm, loss.targets[0][1]) == ("reduce", (0,))
    update = task_plan(plan, "update_L1.W")
    assert [p.ranks for p in update.pieces] == [(0, 1, 2, 3)]
    verify_plan(lcn, plan)


def test_uneven_batch_split():
    graph = load_network("seed-lcn-small").lower(batch=10)
    plan = build_plan(graph, builtin(graph, "data", 4), 4)
    rows = [(p.rect.lo[0], p.rect.hi[0]) for p in task_plan(plan, "L0.filter").pieces]
    assert rows == [(0, 3), (3, 6), (6, 8), (8, 10)]
    verify_plan(graph, plan)


def test_model_split_of_linear_reduce_scatters_its_input_gradient(lcn):
    plan = build_plan(lcn, builtin(lcn, "model", 4), 4)
    grad = task_plan(plan, "classifier.linear1.grad")
    (reduction,) = [r for r in grad.reductions if r.tensor == "L1.filterNL.output.grad"]
    assert reduction.algorithm == "reduce_scatter"
    assert reduction.nbytes == 256 * 64 * 27 * 27 * 4
    verify_plan(lcn, plan)


def test_more_ranks_than_cells_leaves_ranks_idle():
    graph = load_network("seed-lcn-small").lower(batch=3)
    plan = build_plan(graph, builtin(graph, "data", 7), 7)
    assert [p.ranks for p in task_plan(plan, "L0.filter").pieces] == [(0,), (1,), (2,)]


def test_user_grids_must_make_r_pieces(lcn):
    grids = {u.name: [1] * len(u.extents) for u in find_units(lcn)}
    grids["L0"] = [2, 1, 2, 1]
    with pytest.raises(LegionNNError, match=r"makes 4 pieces, not 8"):
        from_grids(lcn, grids, 8)
    grids["L0"] = [1, 1, 34, 1]
    with pytest.raises(LegionNNError, match="cannot be cut into 34"):
        from_grids(lcn, grids, 34)


def test_bad_strategy_and_ranks(lcn):
    with pytest.raises(LegionNNError, match="unknown strategy 'diagonal'"):
        builtin(lcn, "diagonal", 4)
    with pytest.raises(LegionNNError, match="positive int, got 0"):
        builtin(lcn, "data", 0)


def test_verify_plan_catches_a_missing_message(lcn):
    plan = build_plan(lcn, builtin(lcn, "spatial", 4), 4)
    transfers = task_plan(plan, "L1.filter").transfers
    with pytest.raises(AttributeError):
        transfers.pop()  # a view: an edit makes a new task plan
    sent = plan_cost(lcn, plan, Machine()).bytes_sent
    edit_transfers(plan, "L1.filter", transfers[:-1])
    with pytest.raises(VerifyError, match="lacks part"):
        verify_plan(lcn, plan)
    # the cost model reads the same record as verify_plan
    assert plan_cost(lcn, plan, Machine()).bytes_sent == sent - transfers[-1].nbytes * len(
        transfers[-1].dsts
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=networks(), nranks=st.sampled_from([1, 2, 3, 4, 5, 6, 7]), data=st.data())
def test_random_networks_grids_and_rank_counts_verify(graph, nranks, data):
    grids = {}
    for unit in find_units(graph):
        choices = factorizations(unit.extents, unit.splittable, nranks)
        grids[unit.name] = data.draw(st.sampled_from(choices))
    plan = build_plan(graph, Strategy("random", grids), nranks)
    verify_plan(graph, plan)
    with mock.patch.object(verify_module, "PAIRWISE", 0):  # every check by counting
        verify_plan(graph, plan)


def test_verify_plan_counts_the_many_parts_of_a_transpose(lcn):
    # features split 32 ways, then softmax over batch rows: each rank gets 32 parts of its rows
    plan = build_plan(lcn, builtin(lcn, "model", 32), 32)
    softmax = task_plan(plan, "classifier.softmax")
    to_rank0 = [t for t in softmax.transfers if 0 in t.dsts]
    assert len(to_rank0) > PAIRWISE
    verify_plan(lcn, plan)
    name, transfers = softmax.task, list(softmax.transfers)
    edit_transfers(plan, name, [*transfers, to_rank0[0]])
    with pytest.raises(
        VerifyError, match="rank 0 receives part of classifier.linear1.output twice"
    ):
        verify_plan(lcn, plan)
    edit_transfers(plan, name, [t for t in transfers if t is not to_rank0[-1]])
    with pytest.raises(VerifyError, match="rank 0 lacks part"):
        verify_plan(lcn, plan)
    # rank 0's own rows of its own features: it reads them and holds them
    rows, own = to_rank0[0].rect, next(t for t in transfers if t.src == 0).rect
    part = Rect((rows.lo[0], own.lo[1], 0, 0), (rows.hi[0], own.hi[1], 1, 1))
    edit_transfers(
        plan, name, [*transfers, Transfer("classifier.linear1.output", part, 1, (0,), 4)]
    )
    with pytest.raises(VerifyError, match="rank 0 is sent .* which it holds"):
        verify_plan(lcn, plan)


def test_pieces_of_repeated_layers_are_shared_and_equal(lcn):
    from partitioner.pieces import PieceCache, grid_pieces

    graph = load_network("vgg19").lower(batch=4)
    cache = PieceCache(graph)
    grid = (1, 4, 2, 2, 1)
    first, second = graph.task("conv3_2.conv"), graph.task("conv3_3.conv")
    a, b = cache.get(graph, first, grid), cache.get(graph, second, grid)
    assert b.req_lo[0] is a.req_lo[0]  # computed once
    assert b.requirements == second.requirements
    direct = grid_pieces(graph, second, grid)
    for got, want in zip(b.req_lo + b.req_hi, direct.req_lo + direct.req_hi):
        assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(
    extents=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    data=st.data(),
)
def test_layout_of_boxes_that_tile_a_grid(extents, data):
    from partitioner import boxes
    from partitioner.layout import Layout

    parts = [data.draw(st.integers(1, e)) for e in extents]
    bounds = [np.linspace(0, e, p + 1).astype(int) for e, p in zip(extents, parts)]
    cells = list(np.ndindex(*parts))
    ranks = np.array(data.draw(st.permutations(range(len(cells)))), boxes.INDEX)
    lo = np.array([[b[i] for b, i in zip(bounds, c)] for c in cells], boxes.INDEX)
    hi = np.array([[b[i + 1] for b, i in zip(bounds, c)] for c in cells], boxes.INDEX)
    layout = Layout.from_arrays(len(extents), ranks, lo, hi)
    assert layout.cuts == [b.tolist() for b in bounds]
    assert layout.holders == {k: (int(r),) for k, r in enumerate(ranks)}
    # with one box spanning two cells, the general path gives the same holders
    if len(cells) > 1:
        joined = Layout.from_arrays(
            len(extents),
            np.append(ranks, ranks[0]),
            np.vstack([lo, lo[:1]]),
            np.vstack([hi, hi[1:2]]),
        )
        assert joined.cuts == layout.cuts
        assert all(ranks[0] in joined.holders[k] for k in (0, 1))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.data())
def test_a_layouts_cells_by_rank_and_by_rect(extents, data):
    from legion_nn.rect import Rect
    from partitioner import boxes
    from partitioner.layout import Layout

    count = data.draw(st.integers(1, 6))
    ranks, los, his = [], [], []
    for _ in range(count):
        lo = [data.draw(st.integers(0, e - 1)) for e in extents]
        ranks.append(data.draw(st.integers(0, 4)))
        los.append(lo)
        his.append([data.draw(st.integers(a + 1, e)) for a, e in zip(lo, extents)])
    layout = Layout.from_arrays(
        len(extents), np.array(ranks, boxes.INDEX), np.array(los, boxes.INDEX),
        np.array(his, boxes.INDEX),
    )  # fmt: skip
    for rank in range(6):
        held = [
            layout.cell_rect(np.unravel_index(i, [len(c) - 1 for c in layout.cuts]))
            for i, holders in sorted(layout.holders.items())
            if rank in holders
        ]
        assert layout.held_by(rank) == held
    lo = [data.draw(st.integers(0, e)) for e in extents]
    rect = Rect(lo, [data.draw(st.integers(a, e)) for a, e in zip(lo, extents)])
    assert layout.cell_indices(rect) == [index for index, _ in layout.cells(rect)]


def test_balanced_grids_are_the_first_best_of_all_factorizations():
    import random

    from partitioner.strategy import balanced, cells, factorizations

    rng = random.Random(5)
    for _ in range(400):
        ndim = rng.randint(1, 4)
        extents = tuple(rng.randint(1, 60) for _ in range(ndim))
        dims = tuple(sorted(rng.sample(range(ndim), rng.randint(0, ndim))))
        nranks = rng.choice([1, 2, 3, 7, 12, 64, 97, 256])
        best, key = (1,) * ndim, (0, 0)
        for grid in factorizations(extents, dims, nranks):
            parts = [grid[d] for d in dims] or [1]
            found = (cells(grid), -(max(parts) - min(parts)))
            if found > key:
                best, key = grid, found
        assert balanced(extents, dims, nranks) == best


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_verify_plan_models_reads_of_sums_held_by_several_ranks(strategy, nranks):
    # BatchNorm's input gradient reads its gamma and beta gradients, sums held by every rank of
    # their home: the plans verify, and one whose sum misses a holder does not
    from tests.runtime.test_executor import MIXED

    graph = MIXED.lower(batch=3, dtype="float64", optimizer="momentum")
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    verify_plan(graph, plan)
    if nranks == 1:
        return
    tensor = "bn1.gamma.grad"
    index = next(
        (
            i
            for i, t in enumerate(plan.tasks)
            if any(r.tensor == tensor for r in t.reductions)
            or any(m.reduce and m.tensor == tensor for m in t.transfers)
        ),
        None,
    )
    if strategy == "model":  # split by features, each rank sums its own over the whole batch
        assert index is None
        return
    summing = plan.tasks[index]
    plan.tasks[index] = TaskPlan(
        summing.task,
        summing.unit,
        summing.grid,
        summing.piece_sets,
        TransferSet.from_transfers(m for m in summing.transfers if m.tensor != tensor),
        [r for r in summing.reductions if r.tensor != tensor],
        summing.holdings,
    )
    with pytest.raises(VerifyError, match=f"partial sum of .* of {tensor} never reaches"):
        verify_plan(graph, plan)


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
def test_the_record_names_the_last_writer_of_every_cell(strategy):
    # against the pieces: the named task wrote or reduced into the cell, and no task since has
    from tests.runtime.test_executor import MIXED

    graph = MIXED.lower(batch=3, dtype="float64", optimizer="momentum")
    plan = build_plan(graph, builtin(graph, strategy, 3), 3)

    def touches(index, tensor, cell):
        return any(
            req.tensor == tensor and req.privilege.writes and req.write_rect.overlaps(cell)
            for piece in plan.tasks[index].pieces
            for req in piece.requirements
        )

    named = 0
    for index, task_plan in enumerate(plan.tasks):
        for tensor, layout in task_plan.holdings.items():
            writers = plan.written_by[index][tensor]
            assert len(writers) == layout.ncells
            with pytest.raises(ValueError):
                writers[0] = 0  # the record is read-only
            for cell in layout.holders:
                coords = np.unravel_index(cell, [len(c) - 1 for c in layout.cuts])
                rect, writer = layout.cell_rect(coords), int(writers[cell])
                assert 0 <= writer <= index and touches(writer, tensor, rect), (tensor, rect)
                assert not any(touches(i, tensor, rect) for i in range(writer + 1, index + 1))
                named += 1
    assert named > 0


def test_verify_plan_finds_a_sum_whose_collective_leaves_out_a_holder():
    from dataclasses import replace

    from tests.runtime.test_executor import MIXED

    graph = MIXED.lower(batch=3, dtype="float64", optimizer="momentum")
    plan = build_plan(graph, builtin(graph, "data", 3), 3)
    tensor = "bn1.gamma.grad"
    index, summing = next(
        (i, t) for i, t in enumerate(plan.tasks) if any(r.tensor == tensor for r in t.reductions)
    )
    reductions = [
        replace(r, targets=tuple((rect, holders[:-1]) for rect, holders in r.targets))
        if r.tensor == tensor
        else r
        for r in summing.reductions
    ]
    left_out = next(r for r in summing.reductions if r.tensor == tensor).targets[0][1][-1]
    plan.tasks[index] = TaskPlan(
        summing.task,
        summing.unit,
        summing.grid,
        summing.piece_sets,
        summing.transfer_set,
        reductions,
        summing.holdings,
    )
    with pytest.raises(VerifyError, match=f"of {tensor} never reaches rank {left_out},"):
        verify_plan(graph, plan)


def test_a_halo_sent_again_for_the_read_that_fetched_it_is_caught(lcn):
    """L1's backward reads the halo its forward fetched: sending it again is redundant."""
    plan = build_plan(lcn, builtin(lcn, "spatial", 4), 4)
    halo = next(t for t in task_plan(plan, "L1.filter").transfers if t.dsts == (0,))
    verify_plan(lcn, plan)
    grad = task_plan(plan, "L1.filter.grad")
    edit_transfers(plan, grad.task, [*grad.transfers, halo])
    with pytest.raises(VerifyError, match=f"rank 0 is sent .* of {halo.tensor} again"):
        verify_plan(lcn, plan)


def test_a_narrower_read_of_a_fetched_tensor_is_fetched_anew():
    """Copies are kept by read rect: the concat reads a branch input of the trunk's output that
    a 1x1 filter on other ranks already fetched whole, and gets its part sent again (the
    planner's rule, which the verifier follows)."""
    net = Network(
        "branch",
        (1, 6, 6),
        2,
        [
            Filter("L0", out_channels=2, kernel=1),
            Filter("B", out_channels=2, kernel=1, inputs=["L0"]),
            Add("M", inputs=["L0", "B"]),
            Linear("classifier", out=2),
            Softmax(),
            Evaluate(),
        ],
    )
    graph = net.lower(batch=1)
    grids = {unit.name: (1,) * len(unit.extents) for unit in find_units(graph)}
    grids.update(B=(1, 2, 1, 1, 1), M=(1, 2, 1, 1))
    plan = build_plan(graph, Strategy("branch", grids), 2)
    verify_plan(graph, plan)
    fetched = [t for t in task_plan(plan, "M.add").transfers if t.dsts == (1,)]
    assert [t.rect for t in fetched] == [Rect((0, 1, 0, 0), (1, 2, 6, 6))]
