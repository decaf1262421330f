"""The rank executor over the in-process transport: R ranks equal the one-process run.

Every strategy, 1–4 ranks and uneven splits run the plan's programs in threads, in float64, and
must give the one-process run's losses and parameters up to the order of sums (1e-9 relative), with
each rank sending exactly the bytes its program plans. The MPI tests (`tests/runtime/test_distributed.py`) then
run the same programs under `mpiexec`.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.spec import network_from_dict
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.search.auto import auto
from partitioner.strategy import Strategy, builtin, find_units
from runtime import data
from runtime.distributed import RunOptions, train_rank
from runtime.rank_executor import NotOfThisNetwork, RankExecutor, TaskFailure
from runtime.rank_step import StepRun
from runtime.step.order import step_order
from runtime.step.programs import build_programs
from runtime.training import TrainConfig, Trainer
from runtime.transport import ThreadTransport, run_threads
from tests.partitioner.test_gathers import narrowing_network

STEPS = 3


def small_network() -> Network:
    return load_network("seed-lcn-small")


def rows_network() -> Network:
    """27 output rows (to split over 4 ranks: 7, 7, 7, 6), with a halo to exchange."""
    return network_from_dict(
        {
            "name": "rows27",
            "input": [1, 29, 29],
            "classes": 5,
            "layers": [
                {
                    "kind": "filter",
                    "name": "L0",
                    "out_channels": 3,
                    "kernel": [3, 3],
                    "untied": True,
                },
                {"kind": "filterA"},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "filter", "name": "L1", "out_channels": 2, "kernel": [3, 3], "pad": 1},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "classifier", "out": 5},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "rows27",
    )


def config(network: Network, batch: int = 7, **extra) -> TrainConfig:
    dataset = data.synthetic(network.input, network.classes, seed=3, samples=120, dtype=np.float64)
    return TrainConfig(
        network=network, dataset=dataset, batch=batch, dtype="float64", seed=5, **extra
    )


def local_run(cfg: TrainConfig, steps: int = STEPS):
    trainer = Trainer(cfg)
    trainer.executor.prepare(trainer.graph(cfg.batch))
    losses = [trainer.step(step)[0] for step in range(steps)]
    return losses, trainer.executor.resident()


def ranks_run(cfg: TrainConfig, nranks: int, strategy, steps: int = STEPS):
    def body(transport):
        executor = RankExecutor(transport, strategy, seed=cfg.seed, stall_timeout=30)
        trainer = Trainer(cfg, executor=executor)
        executor.prepare(trainer.graph(cfg.batch))
        losses, traffic = [], []
        for step in range(steps):
            losses.append(trainer.step(step)[0])
            traffic.append((executor.last_bytes_sent, executor.last_bytes_planned))
        return losses, executor.resident(), traffic

    return run_threads(nranks, body)


def assert_same(local, ranks) -> None:
    losses, params = local
    got_losses, got_params, _ = ranks[0]
    np.testing.assert_allclose(got_losses, losses, rtol=1e-9, atol=0)
    assert set(got_params) == set(params)
    for name, value in params.items():
        scale = max(np.abs(value).max(), 1e-30)
        assert np.abs(got_params[name] - value).max() / scale < 1e-9, name
    for _, _, traffic in ranks:
        for sent, planned in traffic:
            assert sent == planned


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_ranks_equal_the_local_run(strategy, nranks):
    cfg = config(small_network())  # batch 7: uneven over 2, 3 and 4 ranks
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize("nranks", [5, 8])
def test_gathered_reads_equal_the_local_run(nranks):
    """The classifier's input all-gathered (`partitioner.gathers`): on 5 ranks by halving, a
    rank folded in and out; on 8, three holders that do not read handing their parts on, and
    the input's gradient one reduce-scatter among the classifier's 5 ranks whose partners
    hand those three their sums (`Reduction.contributors`)."""
    network = narrowing_network()
    graph = network.lower(batch=7, dtype="float64")
    plan = build_plan(graph, builtin(graph, "model", nranks), nranks)
    ((_, gather),) = [found for tp in plan.tasks for found in tp.gathered]
    assert len(gather.participants) == nranks and len(gather.targets[0][1]) == 5
    (scatter,) = [r for tp in plan.tasks for r in tp.reductions if r.tensor.endswith(".grad")]
    assert scatter.algorithm == "reduce_scatter" and len(scatter.participants) == nranks
    assert scatter.summed_from == tuple(range(5))
    cfg = config(network)
    assert_same(local_run(cfg), ranks_run(cfg, nranks, "model"))


def test_adding_hops_in_many_segments_equal_the_local_run(monkeypatch):
    """Adding hops received 24 bytes at a time (float64: 3 elements, so that segments end
    inside elements' rows and parameters; one element a segment took 24 s of the suite for
    nothing more, and 40 bytes run under mpiexec in `tests/runtime/test_distributed.py`), each segment added as
    it arrives: the sums are the local run's, the bytes sent the planned."""
    monkeypatch.setenv("LEGION_NN_HOP_SEGMENT_BYTES", "24")
    cfg = config(small_network())
    assert_same(local_run(cfg), ranks_run(cfg, 3, "data"))


def test_auto_equals_the_local_run():

    cfg = config(small_network())
    choose = lambda graph, nranks: auto(graph, nranks, Machine(), 10.0).strategy
    assert_same(local_run(cfg), ranks_run(cfg, 3, choose))


def test_27_rows_over_4_ranks():
    cfg = config(rows_network(), batch=4)

    def rows(graph, nranks):
        """Rows where a unit has 27 or 25 of them, else the batch; 1 where neither splits."""
        grids = {}
        for unit in find_units(graph):
            grid = [1] * len(unit.extents)
            spatial = len(unit.extents) - len(unit.summed) == 4  # (N, C, H, W) outputs
            if 2 in unit.splittable and spatial and unit.extents[2] >= nranks:
                grid[2] = nranks
            elif 0 in unit.splittable and unit.extents[0] >= nranks:
                grid[0] = nranks
            grids[unit.name] = tuple(grid)
        return Strategy("rows", grids)

    graph = cfg.network.lower(batch=4, dtype="float64")
    plan = build_plan(graph, rows(graph, 4), 4)
    l0 = next(tp for tp in plan.tasks if tp.task == "L0.filter")
    assert [p.rect.hi[2] - p.rect.lo[2] for p in l0.pieces] == [7, 7, 7, 6]
    assert any(not t.reduce for tp in plan.tasks for t in tp.transfers)  # halos move
    assert_same(local_run(cfg), ranks_run(cfg, 4, rows))


def test_a_rank_without_a_piece_keeps_its_parameters_current():
    """Batch 2 on 3 data-parallel ranks: rank 2 computes nothing, yet holds and updates copies."""
    cfg = config(small_network(), batch=2)
    local = local_run(cfg)
    ranks = ranks_run(cfg, 3, "data")
    assert_same(local, ranks)


def test_training_with_a_short_last_batch_and_evaluation_matches():
    network = small_network()
    cfg = config(network, batch=32, epochs=1)  # 84 training samples: 32, 32, 20
    local = Trainer(cfg).run()

    def body(transport):
        return train_rank(cfg, transport, RunOptions(strategy="spatial", stall_timeout=30))

    ranked = run_threads(3, body)[0]
    np.testing.assert_allclose(ranked.losses, local.losses, rtol=1e-9)
    assert ranked.test_accuracy == local.test_accuracy
    assert ranked.val_accuracy == local.val_accuracy


def assert_resumes(tmp_path, first: tuple[int, str], then: tuple[int, str], **extra) -> None:
    """An epoch on `first` (ranks, strategy) with `extra` config, checkpointed, then resumed on
    `then` for a second: the losses of two uninterrupted epochs in one process."""
    network = small_network()
    whole = Trainer(config(network, batch=16, epochs=2)).run().losses
    cfg = config(network, batch=16, epochs=1, checkpoint_dir=str(tmp_path), **extra)
    options = RunOptions(strategy=first[1], stall_timeout=30)
    run_threads(first[0], lambda t: train_rank(cfg, t, options))
    second = config(network, batch=16, epochs=2, checkpoint_dir=str(tmp_path), resume=True)
    options = RunOptions(strategy=then[1], stall_timeout=30)
    resumed = run_threads(then[0], lambda t: train_rank(second, t, options))[0]
    np.testing.assert_allclose(resumed.losses, whole[len(whole) - len(resumed.losses) :], rtol=1e-9)
    assert len(resumed.losses) == len(whole) // 2


def test_checkpoint_from_3_ranks_resumes_on_2(tmp_path):
    assert_resumes(tmp_path, (3, "model"), (2, "spatial"))


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_planned_bytes_are_the_cost_models_bytes(strategy, nranks):
    graph = small_network().lower(batch=7, dtype="float64")
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    programs = build_programs(graph, plan, Machine(), range(nranks))
    planned = sum(p.bytes_planned for p in programs.values())
    assert planned == plan_cost(graph, plan, Machine()).bytes_sent


def test_copies_are_posted_right_after_their_producer():
    graph = small_network().lower(batch=4, dtype="float64")
    plan = build_plan(graph, builtin(graph, "spatial", 2), 2)
    program = build_programs(graph, plan, Machine(), [0])[0]
    names = [rt.task.name for rt in program.tasks]
    halos = [m for rt in program.tasks for m in rt.copies_in]
    assert halos
    for message in halos:
        assert message.post_after < message.task
        producer = program.tasks[message.post_after].task
        assert any(
            req.tensor == message.tensor and req.privilege.writes for req in producer.requirements
        ), (message, names[message.post_after])


def test_an_exception_names_the_rank_and_task(monkeypatch):
    monkeypatch.setenv("LEGION_NN_FAULT", "raise:1:L1.filter.grad")
    cfg = config(small_network())
    with pytest.raises(TaskFailure, match=r"rank 1: step 0, task L1.filter.grad: InjectedFault"):
        ranks_run(cfg, 2, "data", steps=1)


def test_trace_events_pair_sends_with_receives(tmp_path):
    cfg = config(small_network(), steps=2)
    trace = tmp_path / "trace.json"
    options = RunOptions(strategy="spatial", stall_timeout=30, trace=str(trace))
    run_threads(2, lambda t: train_rank(cfg, t, options))
    content = json.loads(trace.read_text())
    assert content["otherData"]["format"] == "legion-nn/trace-v1"
    events = [e for e in content["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    computes = [e for e in events if e["cat"] == "compute"]
    assert {e["tid"] for e in computes} == {0}
    assert {e["args"]["task"] for e in computes} >= {"L0.filter", "L1.filter.grad"}
    sends = {e["args"]["id"]: e for e in events if e["cat"] == "send"}
    recvs = [e for e in events if e["cat"] == "recv"]
    assert recvs and all(e["tid"] == 1 for e in recvs)
    for recv in recvs:
        send = sends[recv["args"]["id"]]
        assert send["pid"] == recv["args"]["peer"] and recv["pid"] == send["args"]["peer"]
        assert send["args"]["bytes"] == recv["args"]["bytes"]
    assert any(e["cat"] == "collective" for e in events)


def test_thread_transport_refuses_a_wrong_shape():
    (a, b) = ThreadTransport.group(2)
    a.isend(np.zeros(3), 1, 7)
    request = b.irecv(np.zeros(4), 0, 7)
    with pytest.raises(ValueError, match="shape"):
        request.test()


def test_a_ranks_initial_part_is_that_part_of_the_whole_initial_value():
    import zlib

    from legion_nn.rect import Rect
    from runtime.initial_values import initial_part, initial_value

    graph = load_network("seed-lcn-small").lower(batch=4)
    for name, tensor in graph.tensors.items():
        if tensor.kind != "param":
            continue
        box = Rect(
            tuple(d // 3 for d in tensor.dims),
            tuple(max(d // 3 + 1, d - d // 4) for d in tensor.dims),
        )
        whole = initial_value(tensor, np.random.default_rng([0, zlib.crc32(name.encode())]))
        part = initial_part(tensor, np.random.default_rng([0, zlib.crc32(name.encode())]), box)
        np.testing.assert_array_equal(part, whole[box.to_slices()])


def _with_a_second_reducer(graph):
    """`graph` with L1's affine backward run twice: its parameter gradients get two additions
    in one step, the second onto a gradient that is no longer zero."""
    from dataclasses import replace as replace_task

    from legion_nn.graph import TaskGraph

    tasks = []
    for task in graph.tasks:
        tasks.append(task)
        if task.name == "L1.filterA.grad":
            tasks.append(replace_task(task, name="L1.filterA.grad.again"))
    return TaskGraph(graph.tensors.values(), tasks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_gradient_added_to_twice_is_reduced_in_place_only_the_first_time(nranks, monkeypatch):
    graph = _with_a_second_reducer(small_network().lower(batch=7, dtype="float64"))
    programs = build_programs(graph, build_plan(graph, builtin(graph, "data", nranks), nranks),
                              Machine(), range(nranks))  # fmt: skip
    for program in programs.values():
        by_name = {t.task.name: t for t in program.tasks}
        assert "L1.a.grad" in by_name["L1.filterA.grad"].in_place
        assert "L1.a.grad" not in by_name["L1.filterA.grad.again"].in_place
        assert by_name["L1.filterA.grad.again"].collectives  # reduced through its scratch
    monkeypatch.setattr(Trainer, "graph", lambda self, batch: _with_a_second_reducer(
        self.config.network.lower(batch=batch, dtype="float64")))  # fmt: skip
    cfg = config(small_network())
    assert_same(local_run(cfg), ranks_run(cfg, nranks, "data"))


def test_the_updates_go_after_the_backward_pass_and_every_dependence_holds():
    graph = small_network().lower(batch=4, dtype="float64")
    order = step_order(graph)
    assert sorted(order) == list(range(len(graph.tasks)))
    position = {graph.tasks[i].name: p for p, i in enumerate(order)}
    for dep in graph.dependences:
        assert position[dep.src] < position[dep.dst], dep
    phases = [graph.tasks[i].phase for i in order]
    first_update = phases.index("update")
    assert first_update > max(p for p, phase in enumerate(phases) if phase == "backward")
    assert set(phases[first_update:]) == {"update"}
    others = [i for i in order if graph.tasks[i].phase != "update"]
    assert others == sorted(others)  # everything else keeps the graph's order
    assert order != list(range(len(graph.tasks)))  # the graph interleaves them


def test_a_collective_runs_while_the_backward_pass_goes_on(tmp_path, monkeypatch):
    """Rank 1 stops in a backward task, after starting the all-reduce of the classifier's
    gradient, until rank 0 has computed its lowest layer's gradient. Rank 0 can only get there
    if it does not wait for that all-reduce on the way: only the update that reads the gradient
    waits for the sum."""
    compute = StepRun._compute
    reached = threading.Event()
    released: list[bool] = []

    def gated(self, rt, piece, scratch):
        if self.rank == 1 and rt.task.name == "L1.filterNL.grad":
            released.append(reached.wait(timeout=20))
        compute(self, rt, piece, scratch)
        if self.rank == 0 and rt.task.name == "L0.filter.grad":
            reached.set()

    monkeypatch.setattr(StepRun, "_compute", gated)
    cfg = config(small_network(), steps=1)
    trace = tmp_path / "trace.json"
    options = RunOptions(strategy="data", stall_timeout=60, trace=str(trace))
    run_threads(2, lambda t: train_rank(cfg, t, options))
    assert released == [True]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    on_rank_0 = {(e["cat"], e["name"]): e for e in events if e["pid"] == 0}
    reduction = on_rank_0[("collective", "allreduce classifier.weights1.grad")]
    update = on_rank_0[("compute", "update_W1")]
    assert update["ts"] >= reduction["ts"] + reduction["dur"]


def test_verify_plans_checks_each_plan_before_it_runs(monkeypatch):
    from legion_nn.errors import VerifyError
    from runtime import rank_executor

    cfg = config(small_network())
    checked = []

    def record(graph, plan):
        checked.append((graph.batch, plan.nranks))

    monkeypatch.setattr(rank_executor, "verify_plan", record)

    def body(transport):
        executor = RankExecutor(transport, "model", seed=cfg.seed, verify_plans=True)
        trainer = Trainer(cfg, executor=executor)
        executor.prepare(trainer.graph(cfg.batch))
        trainer.step(0)

    run_threads(2, body)
    assert checked == [(cfg.batch, 2), (cfg.batch, 2)]  # each rank checks its plan once

    def broken(graph, plan):
        raise VerifyError("task L1.filter: pieces overlap")

    monkeypatch.setattr(rank_executor, "verify_plan", broken)
    with pytest.raises(VerifyError, match="pieces overlap"):
        run_threads(2, body)


@pytest.mark.parametrize("strategy", ["data", "model", "spatial", "auto"])
@pytest.mark.parametrize("nranks", [1, 3])
def test_batchnorm_dropout_and_every_op_equal_the_local_run(strategy, nranks):
    """BatchNorm's running statistics (state with a home of its own, updated where they live)
    and its statistics, a sum of the ranks' parts that every rank then reads: a copy of a
    tensor under reduction carries the finished sum (on 3 ranks it once carried a part)."""
    from tests.runtime.test_executor import MIXED

    cfg = config(MIXED, batch=6)
    if strategy == "auto":  # BatchNorm's statistics make it no chain: the DP over dependencies
        strategy = lambda graph, nranks: auto(graph, nranks, Machine(), 10.0).strategy
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize("strategy", ["data", "model", "spatial", "auto"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_a_residual_network_with_a_concat_equals_the_local_run(strategy, nranks):
    """An add and a concat split over the batch, their channels or their rows: a concat's piece
    fetches only the channels of its inputs it covers; the block input's gradient is the sum of
    the shortcut's and the block's contributions, wherever each is made."""
    from tests.runtime.test_executor import RESIDUAL

    cfg = config(RESIDUAL, batch=6)
    if strategy == "auto":
        strategy = lambda graph, nranks: auto(graph, nranks, Machine(), 10.0).strategy
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_the_step_records_the_buffer_peak_against_the_predicted_memory(strategy, nranks):
    """`buffer_peak_bytes` is what the runtime holds on each rank, the resident tensors and the
    arena of its step buffers: exactly the prediction (`runtime.step.rank_memory`), which places the
    same buffers. Reusing the space of buffers after their last use holds less than keeping
    every step tensor all step. `rss_peak_bytes` is the process's high-water mark."""
    from runtime.step.rank_memory import predict

    cfg = config(small_network(), batch=8)

    def body(transport, keep):
        executor = RankExecutor(
            transport, strategy, seed=cfg.seed, stall_timeout=30, keep_step_tensors=keep
        )
        trainer = Trainer(cfg, executor=executor)
        graph = trainer.graph(cfg.batch)
        executor.prepare(graph)
        records = []
        for step in range(2):
            trainer.step(step)
            records.append(executor.step_extras())
        return records, graph

    out = run_threads(nranks, lambda transport: body(transport, False))
    kept = run_threads(nranks, lambda transport: body(transport, True))
    graph = out[0][1]
    predicted = predict(graph, build_plan(graph, builtin(graph, strategy, nranks), nranks))
    for rank, (records, _) in enumerate(out):
        first, second = records
        assert first["buffer_peak_bytes"] == second["buffer_peak_bytes"]
        assert first["rss_peak_bytes"] <= second["rss_peak_bytes"]
        assert second["buffer_peak_bytes"] == predicted[rank].buffer_bytes
        assert second["buffer_peak_bytes"] < kept[rank][0][1]["buffer_peak_bytes"]


@pytest.mark.parametrize(
    "strategy,nranks", [("data", 1), ("data", 2), ("spatial", 3), ("model", 2)]
)
def test_the_first_contribution_writes_and_its_zeroing_is_elided(strategy, nranks, monkeypatch):
    """Where a task's one piece makes the first contribution to a gradient over exactly what a
    `set_zero` task zeroed, it writes and the zeroing is not run: no pass over a weight-sized
    gradient. Adding to zeros and writing give the same bits, so the run equals one in which
    every zeroing runs, exactly."""
    from runtime.step import rank_builder

    graph = small_network().lower(batch=7, dtype="float64", optimizer="adam")
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    program = build_programs(graph, plan, Machine(), [0])[0]
    elided = {rt.task.name for rt in program.tasks if rt.elided}
    fresh = {tensor for rt in program.tasks for tensor in rt.fresh}
    assert "L1.W.grad.set_zero" in elided and "L1.W.grad" in fresh
    for rt in program.tasks:
        for tensor in rt.fresh:  # what the task writes is what was zeroed, on this rank
            assert f"{tensor}.set_zero" in elided
    cfg = config(small_network())
    written = ranks_run(cfg, nranks, strategy)
    monkeypatch.setattr(rank_builder.Builder, "_first_contribution", lambda *args: None)
    added = ranks_run(cfg, nranks, strategy)
    assert written[0][0] == added[0][0]
    for name, value in added[0][1].items():
        assert np.array_equal(written[0][1][name], value), name


@pytest.mark.parametrize(("nranks", "strategy"), [(1, "data"), (2, "model"), (3, "spatial")])
def test_values_to_start_from_are_taken_without_drawing_the_initial_ones(
    monkeypatch, nranks, strategy
):
    """Parameters and state given to `prepare` (a checkpoint's, an imported model's) are each
    rank's part of them, as `load_resident` after the initial draws would set them, and the
    tensors given are not drawn; an array of another shape is one error naming it."""
    from runtime import rank_executor

    graph = small_network().lower(batch=4, dtype="float64", optimizer="adam")
    rng = np.random.default_rng(3)
    given = {
        name: rng.standard_normal(tensor.dims)
        for name, tensor in graph.tensors.items()
        if tensor.kind == "param"
    }
    drawn = []
    real_draw = rank_executor.initial_part
    monkeypatch.setattr(
        rank_executor, "initial_part", lambda t, *a: drawn.append(t.name) or real_draw(t, *a)
    )

    def resident(load_after: bool):
        def run(transport):
            executor = RankExecutor(transport, strategy)
            if load_after:
                executor.prepare(graph)
                executor.load_resident(given)
            else:
                executor.prepare(graph, given)
            return executor.resident()

        return run_threads(nranks, run)[0]

    taken = resident(False)
    drawn_when_given, drawn[:] = set(drawn), []
    loaded = resident(True)
    assert taken.keys() == loaded.keys() > given.keys()
    for name in taken:
        np.testing.assert_array_equal(taken[name], loaded[name])
    for name, value in given.items():
        np.testing.assert_array_equal(taken[name], value)
    assert given.keys() <= set(drawn)  # drawn, then loaded over
    assert drawn_when_given == set(drawn) - given.keys()  # the optimizer's state alone
    wrong = dict(given, **{"L1.W": np.zeros((2, 2))})
    with pytest.raises(NotOfThisNetwork, match=r"tensor L1\.W \[2, 2\] does not fit this network"):
        RankExecutor(ThreadTransport.group(1)[0], "data").prepare(graph, wrong)
