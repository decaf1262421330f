"""Sharded parameter homes (ZeRO-3): plans, runs equal to replicated homes, memory, checkpoints.

A sharded home cuts every part of a parameter that several ranks read among them; its gradient and
optimizer state follow it. Readers fetch the rest just before each use and drop it after, the
gradient's partial sums are reduce-scattered onto the shards and the update runs on each shard.
In float64 the losses and parameters equal the one-process run's (and so replicated homes'), and
each rank sends exactly what its program plans.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.networks import load_network
from legion_nn.op_records import PACKED_AXES
from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import Strategy, builtin, factorizations, find_units, with_homes
from partitioner.verify_plan import verify_plan
from runtime.distributed import RunOptions, train_rank
from runtime.kernels.layout import WEIGHT_AXES
from runtime.step.programs import build_programs
from runtime.transport import run_threads
from tests.cli.test_fail_inputs import run_cli
from tests.plan_cases import networks
from tests.runtime.test_rank_executor import (
    assert_same,
    config,
    local_run,
    ranks_run,
    small_network,
)


def sharded(graph, strategy: str, nranks: int) -> Strategy:
    return with_homes(graph, builtin(graph, strategy, nranks), "sharded")


def elements(layout: Layout, shape: tuple[int, ...]) -> np.ndarray:
    """How many holders each element has."""
    count = np.zeros(shape, int)
    for index, holders in layout.holders.items():
        coords = np.unravel_index(index, [len(c) - 1 for c in layout.cuts])
        rect = layout.cell_rect(tuple(int(i) for i in coords))
        count[rect.to_slices()] += len(holders)
    return count


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_sharded_layout_gives_every_element_one_holder_among_its_readers(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    pieces = []
    for rank in range(data.draw(st.integers(1, 6))):
        lo = [data.draw(st.integers(0, n - 1)) for n in shape]
        hi = [data.draw(st.integers(a + 1, n)) for a, n in zip(lo, shape)]
        pieces.append((rank, Rect(lo, hi)))
    layout = Layout.from_pieces(len(shape), pieces)
    order = data.draw(st.permutations(range(len(shape))))
    cut = layout.sharded(order)
    held = elements(layout, shape) > 0
    assert (elements(cut, shape) == held).all()  # one holder where anyone held, none elsewhere
    for index, holders in cut.holders.items():
        coords = np.unravel_index(index, [len(c) - 1 for c in cut.cuts])
        rect = cut.cell_rect(tuple(int(i) for i in coords))
        (rank,) = holders
        assert any(r == rank and p.contains(rect) for r, p in pieces)  # a reader of it holds it


def test_a_shard_is_cut_along_the_outermost_axis_its_extent_allows():
    layout = Layout.from_pieces(3, [(rank, Rect.from_dims((8, 3, 5))) for rank in range(4)])

    def owners(order) -> np.ndarray:
        out = np.full((8, 3, 5), -1)
        cut = layout.sharded(order)
        for rank in range(4):
            for rect in cut.held_by(rank):
                out[rect.to_slices()] = rank
        return out

    assert (owners((0, 1, 2)) == np.arange(8)[:, None, None] // 2).all()
    # stored (3, 5, 8): 3 indices for 4 holders, 2, 1 and 1 of them; the first index's two cut
    # its 5 along the next axis
    expected = np.empty((8, 3, 5), int)
    expected[:, 0, :3], expected[:, 0, 3:], expected[:, 1], expected[:, 2] = 0, 1, 2, 3
    assert (owners((1, 2, 0)) == expected).all()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)), st.permutations(range(len(shape))), st.integers(1, 40)
        )
    )
)
def test_every_shard_is_one_contiguous_block_of_the_stored_order(case):
    from partitioner.layout import shard_cell
    from runtime.step.buffers import contiguous

    shape, order, holders = case
    parts = shard_cell(Rect.from_dims(shape), list(range(holders)), order)
    volume = int(np.prod(shape))
    assert len(parts) == min(holders, volume)
    ranks = [rank for rank, _ in parts]
    assert ranks == sorted(set(ranks))
    count = np.zeros(shape, int)
    starts = []
    for _, part in parts:
        count[part.to_slices()] += 1
        stored = tuple(part.shape[d] for d in order)
        assert contiguous(stored, tuple(shape[d] for d in order))
        starts.append(
            np.ravel_multi_index(tuple(part.lo[d] for d in order), [shape[d] for d in order])
        )
    assert (count == 1).all()
    assert starts == sorted(starts)  # in holder order along the storage
    sizes = [part.volume for _, part in parts]
    assert max(sizes) <= 2 * volume / len(parts) + 1


def test_the_packed_filter_layout_the_planner_shards_by_is_the_kernels():
    assert PACKED_AXES[: len(WEIGHT_AXES)] == WEIGHT_AXES
    assert sorted(PACKED_AXES) == list(range(8))


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_sharded_homes_hold_each_element_once_and_their_plans_verify(strategy, nranks):
    graph = small_network().lower(batch=7, dtype="float64", optimizer="adam")
    plan = build_plan(graph, sharded(graph, strategy, nranks), nranks)
    verify_plan(graph, plan)
    for name, tensor in graph.tensors.items():
        if tensor.kind != "param":
            continue
        home = plan.homes[name]
        assert (elements(home, tensor.dims) == 1).all(), name
        for follower in (f"{name}.grad", f"{name}.m", f"{name}.v"):
            assert plan.homes[follower] is home


def test_data_parallel_sharded_homes_gather_before_each_use_and_reduce_scatter():
    """Each of 4 readers of the classifier's weights fetches the 3 shards it lacks for the
    forward task and again for the backward one; its gradient is reduce-scattered."""
    graph = small_network().lower(batch=8, dtype="float32", optimizer="adam")
    plan = build_plan(graph, sharded(graph, "data", 4), 4)
    weights = "classifier.weights1"
    nbytes = graph.tensors[weights].nbytes
    fetched = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        moved = [t for t in task_plan.transfers if t.tensor == weights and not t.reduce]
        if moved:
            fetched[task.name] = sum(t.nbytes * len(t.dsts) for t in moved)
    assert fetched == {"classifier.linear1": 3 * nbytes, "classifier.linear1.grad": 3 * nbytes}
    (reduction,) = [
        r for task_plan in plan.tasks for r in task_plan.reductions if r.tensor == f"{weights}.grad"
    ]
    assert reduction.algorithm == "reduce_scatter"
    assert sorted(len(h) for _, h in reduction.targets) == [1, 1, 1, 1]


@settings(max_examples=25, deadline=None)
@given(graph=networks(), nranks=st.sampled_from([2, 3, 4]), data=st.data())
def test_random_networks_with_sharded_homes_verify(graph, nranks, data):
    grids = {}
    for unit in find_units(graph):
        choices = factorizations(unit.extents, unit.splittable, nranks)
        grids[unit.name] = data.draw(st.sampled_from(choices))
    params = frozenset(n for n, t in graph.tensors.items() if t.kind == "param")
    verify_plan(graph, build_plan(graph, Strategy("random", grids, params), nranks))


@pytest.mark.parametrize(
    "strategy,nranks", [("data", 2), ("data", 4), ("model", 3), ("spatial", 4), ("spatial", 3)]
)
def test_sharded_homes_equal_the_local_run(strategy, nranks):
    cfg = config(small_network())  # batch 7: uneven
    choose = lambda graph, n: sharded(graph, strategy, n)
    ranks = ranks_run(cfg, nranks, choose)
    assert_same(local_run(cfg), ranks)
    assert all(sent > 0 for _, _, traffic in ranks for sent, _ in traffic)


def test_sharded_homes_in_stages_with_deferred_gradients_equal_the_local_run():
    """2 stages of 2 ranks, the parameters sharded within each: the classifier's gradient,
    deferred over every micro-batch, goes to its shards' homes."""
    cfg = config(small_network(), batch=8, stages=2, micro_batches=4, schedule="1f1b-deferred")
    choose = lambda graph, n: sharded(graph, "data", n)
    assert_same(local_run(config(small_network(), batch=8)), ranks_run(cfg, 4, choose))


def test_a_window_is_fetched_just_before_its_reader_and_moves_with_no_staging_copy():
    """The shards of a weight cut along its outermost axis go from the home and into the
    reader's window as they lie: no send or receive buffer."""
    from runtime.instances import choose_storage_orders
    from runtime.step.buffers import direct, step_buffers

    graph = small_network().lower(batch=8, dtype="float32", optimizer="adam")
    plan = build_plan(graph, sharded(graph, "data", 4), 4)
    program = build_programs(graph, plan, Machine(), [1])[1]
    layouts = choose_storage_orders(graph)
    gathers = [m for rt in program.tasks for m in rt.copies_in if m.tensor == "L1.W"]
    assert len(gathers) == 6  # three shards, for the forward and the backward task
    for m in gathers:
        assert m.post_after == m.task - 1
        assert direct(graph, program, m, layouts)
    placed = step_buffers(graph, program, layouts)
    for m in gathers:
        assert ("recv", m.seq) not in placed.slots
        window = placed.slots[("window", m.task, "L1.W")]
        assert window.nbytes == graph.tensors["L1.W"].nbytes
        assert (window.first, window.last) == (m.task - 1, m.task)


@pytest.mark.parametrize("homes", ["replicated", "sharded"])
def test_sharded_homes_hold_less_than_replicated_and_the_prediction_is_what_runs(homes):
    from runtime.rank_executor import RankExecutor
    from runtime.step.rank_memory import predict
    from runtime.training import Trainer

    cfg = config(small_network(), batch=8)

    def body(transport):
        choose = lambda graph, n: with_homes(graph, builtin(graph, "data", n), homes)
        executor = RankExecutor(transport, choose, seed=cfg.seed, stall_timeout=30)
        trainer = Trainer(cfg, executor=executor)
        graph = trainer.graph(cfg.batch)
        trainer.step(0)
        return executor.step_extras()["buffer_peak_bytes"], graph

    out = run_threads(4, body)
    graph = out[0][1]
    plan = build_plan(graph, with_homes(graph, builtin(graph, "data", 4), homes), 4)
    predicted = predict(graph, plan)
    for rank, (peak, _) in enumerate(out):
        assert peak == predicted[rank].buffer_bytes
    if homes == "sharded":
        replicated = predict(graph, build_plan(graph, builtin(graph, "data", 4), 4))
        params = sum(t.nbytes for t in graph.tensors.values() if t.kind in ("param", "state"))
        for rank, memory in predicted.items():
            saved = replicated[rank].buffer_bytes - memory.buffer_bytes
            # 3/4 of the parameters and moments, less one window, and less what halving's
            # reduce-scatters hold that the ring's would not: its first round adds half a
            # gradient where the ring adds a quarter (`collectives`)
            assert saved > params / 3


def test_a_sharded_checkpoint_resumes_replicated_on_another_rank_count(tmp_path):
    """Checkpoints hold whole logical tensors, whatever the homes that wrote them."""
    network = small_network()
    from runtime.training import Trainer

    whole = Trainer(config(network, batch=16, epochs=2)).run().losses
    first = config(network, batch=16, epochs=1, checkpoint_dir=str(tmp_path))
    options = RunOptions(strategy="data", param_homes="sharded", stall_timeout=30)
    run_threads(3, lambda t: train_rank(first, t, options))
    shutil.copytree(tmp_path, tmp_path.parent / "copy")
    second = config(network, batch=16, epochs=2, checkpoint_dir=str(tmp_path), resume=True)
    options = RunOptions(strategy="spatial", stall_timeout=30)
    resumed = run_threads(2, lambda t: train_rank(second, t, options))[0]
    np.testing.assert_allclose(resumed.losses, whole[len(whole) - len(resumed.losses) :], rtol=1e-9)
    third = config(
        network, batch=16, epochs=2, checkpoint_dir=str(tmp_path.parent / "copy"), resume=True
    )
    options = RunOptions(strategy="model", param_homes="sharded", stall_timeout=30)
    again = run_threads(4, lambda t: train_rank(third, t, options))[0]
    np.testing.assert_allclose(again.losses, resumed.losses, rtol=1e-9)


def test_the_commands_take_param_homes_and_refuse_a_bad_one(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli(
        "partition", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", "data",
        "--param-homes", "sharded", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sharded homes" in result.stdout
    bad = run_cli("partition", "seed-lcn-small", "--ranks", "2", "--param-homes", "half")
    assert bad.returncode == 2 and "--param-homes" in bad.stderr
    assert "Traceback" not in bad.stderr
    lonely = run_cli("memory", "seed-lcn-small", "--param-homes", "sharded")
    assert lonely.returncode != 0 and "--param-homes needs --strategy" in lonely.stderr


def test_a_large_plan_with_sharded_homes_covers_every_cell_once():
    """vgg19 on 1024 data-parallel ranks: each weight in 1024 shards, fetched twice a step;
    `verify_plan` raises where a piece, a shard or a message leaves a cell uncovered or covers
    it twice."""
    graph = load_network("vgg19").lower(batch=256, optimizer="adam")
    plan = build_plan(graph, sharded(graph, "data", 1024), 1024)
    verify_plan(graph, plan)


def test_memory_of_a_plan_gives_each_ranks_peak_its_parts_and_a_plot(tmp_path):
    """`legion-nn memory --strategy`: the runtime's prediction per rank, whose parts add up to
    its peak, and the live bytes over the step, the same as `runtime.step.rank_memory` places them."""
    import json

    from runtime.step.rank_memory import predict

    out, plot = tmp_path / "memory.json", tmp_path / "live.png"
    result = run_cli(
        "memory", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", "data",
        "--param-homes", "sharded", "--json", str(out), "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sharded homes" in result.stdout
    report = json.loads(out.read_text())
    graph = small_network().lower(batch=8, optimizer="adam")
    plan = build_plan(graph, sharded(graph, "data", 4), 4)
    predicted = predict(graph, plan)
    assert report["peak_bytes"] == max(m.peak for m in predicted.values())
    for row in report["per_rank"]:
        memory = predicted[row["rank"]]
        assert row["peak_bytes"] == memory.peak == sum(row["breakdown"].values())
        assert row["live_bytes"] == memory.live().tolist()
        assert row["breakdown"]["fetched parameters"] > 0  # the windows of sharded weights
    assert plot.read_bytes()[:4] == b"\x89PNG"
