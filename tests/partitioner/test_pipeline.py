"""Pipelines (`partitioner.pipeline`): layers in stages on groups of ranks, micro-batches
streamed through them in 1F1B or GPipe order.

Stage cuts are contiguous and as balanced as a brute force finds; each stage's order is the
schedule's, the merged task list keeps every stage's order; every stage's pieces lie on its
ranks; the plans cover every task disjointly; and R ranks in S stages compute the one-process
full-batch step in float64 (1e-9 relative), each rank sending exactly what its program plans.
"""

from __future__ import annotations

from itertools import combinations, pairwise

import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.micro_batches import schedule_of, stage_order, stages_of
from legion_nn.networks import load_network
from legion_nn.op_records import flops_per_element
from legion_nn.spec import network_from_dict
from partitioner.machine import Machine
from partitioner.pipeline import pipelined, stage_cuts
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.strategy import BUILTIN, builtin, find_units
from partitioner.verify_plan import verify_plan
from runtime.step import prediction
from runtime.step.buffers import ACTIVATIONS, step_buffers
from runtime.step.model import StepModel
from runtime.step.prediction import predict_step, simulate_compiled
from runtime.step.programs import build_programs
from runtime.step.simulator import simulate_step
from tests.fresh_process import in_fresh_process
from tests.legion_nn.test_micro_batches import mlp_network
from tests.runtime.test_rank_executor import (
    assert_resumes,
    assert_same,
    config,
    local_run,
    ranks_run,
    small_network,
)
from visualize.step_timeline import timeline_figure


def residual_network():
    """Two blocks whose skip connection crosses the cut between two stages."""
    return network_from_dict(
        {
            "name": "skip",
            "input": [2, 8, 8],
            "classes": 4,
            "layers": [
                {"kind": "filter", "name": "A", "out_channels": 3, "kernel": 3, "pad": 1},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "filter", "name": "B", "out_channels": 3, "kernel": 3, "pad": 1},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "filter", "name": "C", "out_channels": 3, "kernel": 3, "pad": 1},
                {"kind": "add", "name": "skip", "inputs": ["A", "C"]},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "classifier", "out": 4},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "skip",
    )


def _work(graph, unit) -> float:
    tasks = [graph.task(n) for n in (*unit.forward, *unit.backward)]
    return sum(flops_per_element(t, graph.tensors) * t.space.volume for t in tasks)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stage_cuts_are_contiguous_and_the_heaviest_stage_is_lightest(stages):
    graph = load_network("deep-mlp").lower(batch=8)
    units = [u for u in find_units(graph) if u.backward]
    cuts = stage_cuts(graph, stages)
    assert [cuts[u.name] for u in units] == sorted(cuts[u.name] for u in units)
    assert set(cuts.values()) == set(range(stages))
    work = [_work(graph, u) for u in units]

    def heaviest(bounds):
        edges = (0, *bounds, len(work))
        return max(sum(work[a:b]) for a, b in pairwise(edges))

    found = [next(i for i, u in enumerate(units) if cuts[u.name] == s) for s in range(1, stages)]
    best = min(heaviest(b) for b in combinations(range(1, len(work)), stages - 1))
    assert heaviest(found) == best


def test_1f1b_keeps_fewer_micro_batches_in_flight_on_early_stages():
    for stage in range(4):
        order = stage_order(stage, 4, 8, "1f1b")
        assert sorted(order) == sorted([("F", m) for m in range(8)] + [("B", m) for m in range(8)])
        live = peak = 0
        for kind, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - stage
    assert stage_order(1, 4, 3, "gpipe") == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                                              ("B", 2)]  # fmt: skip


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_task_list_holds_every_stages_order(schedule):
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), 3, 4, schedule)
    assert stages_of(graph) == 3 and schedule_of(graph) == (4, schedule)
    for stage in range(3):
        seen = []
        for task in graph.tasks:
            if task.attrs.get("stage") != stage or task.phase not in ("forward", "backward"):
                continue
            key = ("F" if task.phase == "forward" else "B", task.attrs["micro_batch"])
            if not seen or seen[-1] != key:
                seen.append(key)
        assert seen == stage_order(stage, 3, 4, schedule)


def _passes(graph) -> list[tuple[str, int, int]]:
    """The graph's (kind, stage, micro-batch) passes in task-list order."""
    seen: list[tuple[str, int, int]] = []
    for task in graph.tasks:
        if "stage" not in task.attrs or task.phase not in ("forward", "backward"):
            continue
        key = (
            "F" if task.phase == "forward" else "B",
            task.attrs["stage"],
            task.attrs["micro_batch"],
        )
        if not seen or seen[-1] != key:
            seen.append(key)
    return seen


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "count"), [(2, 4), (2, 8), (3, 3), (3, 6), (4, 8)])
def test_a_stage_waits_for_the_gradient_it_needs_next(schedule, stages, count):
    """A stage adds the next stage's partial sum into its boundary gradient where that backward
    sits in the task list: the one it sits after must be the backward the stage runs next, or
    the stage would wait for a later micro-batch before computing its current one."""
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), stages, count, schedule)
    passes = _passes(graph)
    for at, (kind, stage, m) in enumerate(passes):
        if kind != "B" or stage == stages - 1:
            continue
        later = [p for p in passes[:at] if p[:2] == ("B", stage + 1)]
        assert later[-1] == ("B", stage + 1, m), (kind, stage, m)


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_each_stage_computes_on_its_own_ranks(strategy):
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), 2, 4)
    plan = build_plan(graph, builtin(graph, strategy, 4), 4)
    verify_plan(graph, plan)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        stage = task.attrs.get("stage")
        if stage is None or task_plan.grid is None or task.op == "set_zero":
            continue  # a zeroing runs where what it zeroes lives (`strategy.task_placement`)
        ranks = {r for piece in task_plan.pieces for r in piece.ranks}
        assert ranks <= {2 * stage, 2 * stage + 1}, task.name
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task.name in (
            "classifier.softmax.output.set_zero",
            "classifier.evaluate.output.set_zero",
        ):
            # the step's statistics live on the stage computing them: no stage waits for them
            assert {r for piece in task_plan.pieces for r in piece.ranks} <= {2, 3}, task.name
    crossing = {t.tensor for tp in plan.tasks for t in tp.transfers if not t.reduce}
    assert "fc4.filterNL.output@0" in crossing  # the activation at the cut, forward
    assert "fc4.filterNL.output@0.grad" not in crossing  # its gradient is summed back


@pytest.mark.parametrize(
    ("network", "nranks", "strategy", "stages", "count", "schedule"),
    [
        (small_network, 2, "data", 2, 4, "1f1b"),
        (small_network, 2, "data", 2, 4, "gpipe"),
        (small_network, 4, "data", 2, 4, "1f1b"),
        (small_network, 4, "model", 2, 2, "gpipe"),
        (small_network, 3, "spatial", 3, 4, "1f1b"),
        (residual_network, 2, "data", 2, 4, "1f1b"),
        (residual_network, 4, "spatial", 2, 4, "gpipe"),
        (mlp_network, 2, "data", 2, 3, "1f1b-deferred"),  # micro-batches of 3, 3 and 2
        (mlp_network, 4, "model", 2, 3, "1f1b-deferred"),
        (mlp_network, 4, "data", 2, 4, "gpipe-deferred"),
        (residual_network, 2, "data", 2, 4, "1f1b-deferred"),
    ],
)
def test_ranks_in_stages_equal_the_full_batch_in_one_process(
    network, nranks, strategy, stages, count, schedule
):
    full = local_run(config(network(), batch=8))
    cfg = config(network(), batch=8, micro_batches=count, schedule=schedule, stages=stages)
    assert_same(full, ranks_run(cfg, nranks, strategy))


def test_the_skip_connection_crosses_the_cut():
    _, cuts = pipelined(residual_network().lower(batch=8), 2, 2)
    assert cuts["A"] == 0 and cuts["skip"] == 1


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_both_simulators_run_the_pipeline_alike(strategy):
    machine = Machine(link_gbytes_per_s=0.1, latency_us=50)
    for schedule in ("1f1b", "gpipe"):
        graph, _ = pipelined(load_network("seed-lcn-small").lower(batch=16), 2, 4, schedule)
        plan = build_plan(graph, builtin(graph, strategy, 4), 4)
        programs = build_programs(graph, plan, machine, range(4))
        exact = predict_step(graph, plan, machine, programs=programs, simulate=simulate_step)
        fast = predict_step(graph, plan, machine, programs=programs, simulate=simulate_compiled)
        assert (fast.seconds, fast.finish, fast.waiting) == (
            exact.seconds, exact.finish, exact.waiting
        )  # fmt: skip
        assert max(exact.waiting.values()) > 0  # the bubble


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-deferred"])
def test_a_stage_waits_for_its_sends_where_it_next_computes(schedule):
    """The last stage sums each micro-batch's gradient at the cut back into the first stage's
    rank and goes on to its next task: it waits for the send at the end of the first task it
    computes after the message's consumer (the sending task itself), not at the consumer, where
    it had waited for the message's whole time on the wire; its send buffer lives until then.
    The first stage's copies of the activations at the cut are waited for alike."""
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), 2, 4, schedule)
    plan = build_plan(graph, builtin(graph, "model", 2), 2)
    programs = build_programs(graph, plan, Machine(), range(2))
    for rank, kind, expected in ((1, "partial_out", 4), (0, "post", 4)):
        program = programs[rank]
        buffers = step_buffers(graph, program)
        sent = [
            m for rt in program.tasks for m in getattr(rt, kind) if m.src == rank and m.nbytes > 64
        ]
        assert len(sent) == expected, (rank, kind)
        for m in sent:
            released = program.send_released(m)
            assert released > m.task and program.tasks[released].runs
            assert not any(program.tasks[i].runs for i in range(m.task + 1, released))
            assert buffers.slots["send", m.seq].last == released


def test_1f1b_holds_fewer_activations_than_gpipe_on_the_first_stage():
    base = load_network("seed-lcn-small").lower(batch=64)

    def activations(schedule: str) -> int:
        graph, _ = pipelined(base, 2, 8, schedule)
        plan = build_plan(graph, builtin(graph, "data", 2), 2)
        buffers = step_buffers(graph, build_programs(graph, plan, Machine(), [0])[0])
        return max(buffers.by_kind(p).get(ACTIVATIONS, 0) for p in range(buffers.length))

    one_f_one_b, gpipe = activations("1f1b"), activations("gpipe")
    assert 3 * one_f_one_b < gpipe  # two micro-batches live against all eight


def test_1f1b_measures_fewer_bytes_than_gpipe_and_both_as_predicted():
    """2 stages of a rank each, 8 micro-batches: the runtime's buffers peak at exactly what
    `step_memory` predicts under both schedules, and lower under 1F1B on the first stage."""
    from runtime.rank_executor import RankExecutor
    from runtime.step.rank_memory import predict
    from runtime.training import Trainer
    from runtime.transport import run_threads

    def measured(schedule: str) -> tuple[list[int], list[int]]:
        cfg = config(small_network(), batch=16, stages=2, micro_batches=8, schedule=schedule)

        def body(transport):
            executor = RankExecutor(transport, "data", seed=cfg.seed, stall_timeout=30)
            trainer = Trainer(cfg, executor=executor)
            graph = trainer.graph(cfg.batch)
            executor.prepare(graph)
            trainer.step(0)
            return executor.step_extras()["buffer_peak_bytes"], graph

        out = run_threads(2, body)
        graph = out[0][1]
        predicted = predict(graph, build_plan(graph, builtin(graph, "data", 2), 2))
        return [peak for peak, _ in out], [predicted[r].buffer_bytes for r in range(2)]

    one_f_one_b, gpipe = measured("1f1b"), measured("gpipe")
    assert one_f_one_b[0] == one_f_one_b[1] and gpipe[0] == gpipe[1]
    assert one_f_one_b[0][0] < gpipe[0][0]
    deferred = measured("1f1b-deferred")  # the classifier's inputs kept to the stage's end
    assert deferred[0] == deferred[1]


@pytest.mark.parametrize(
    ("stages", "nranks", "message"),
    [
        (3, 4, "--stages 3 does not divide the 4 ranks"),
        (20, 20, "--stages 20 is more than the 4 layers of seed-lcn-small"),
        (0, 2, "--stages must be at least 1"),
    ],
)
def test_bad_stages_are_named(stages, nranks, message):
    base = load_network("seed-lcn-small").lower(batch=64)
    with pytest.raises(LegionNNError, match=message):
        graph, _ = pipelined(base, stages, 2 * max(stages, 1))
        builtin(graph, "data", nranks)


def test_a_checkpoint_of_two_stages_resumes_without_them(tmp_path):
    """Checkpoints hold whole logical tensors: a pipeline's resumes as plain model parallelism."""
    assert_resumes(tmp_path, (2, "data"), (2, "model"), stages=2, micro_batches=4)


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-deferred"])
def test_the_timeline_draws_every_ranks_tasks_where_the_simulator_ran_them(tmp_path, schedule):
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=16), 2, 4, schedule)
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    machine = Machine(link_gbytes_per_s=0.1)
    programs = build_programs(graph, plan, machine, range(2))
    step = predict_step(graph, plan, machine, programs=programs, simulate=simulate_step)
    for rank in range(2):
        bars = sorted((s, e) for r, _, s, e in step.timeline if r == rank)
        assert all(e0 <= s1 for (_, e0), (s1, _) in pairwise(bars))  # one task at a time
        assert 0 <= bars[0][0] and bars[-1][1] <= step.finish[rank]
        busy = sum(e - s for s, e in bars)
        assert busy + step.waiting[rank] == pytest.approx(step.finish[rank], rel=1e-6)
    bars = [(r, programs[r].tasks[i].task, start, end) for r, i, start, end in step.timeline]
    figure = timeline_figure(
        bars, step.seconds, list(step.waiting), step.waiting_fraction, "deep-mlp"
    )
    (ax,) = figure.axes
    assert len(ax.patches) == len(step.timeline)
    labels = {t.get_text() for t in ax.texts}
    assert {"F0", "F3", "B0", "B3"} <= labels
    # each stage ends with its weight gradients over every micro-batch, one bar a stage
    assert ("W" in labels) == (schedule == "1f1b-deferred")
    out = tmp_path / "timeline.png"
    argv = ["render", "deep-mlp", "--batch", "16", "--ranks", "2", "--strategy", "data",
            "--stages", "2", "--timeline", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0 and out.read_bytes().startswith(b"\x89PNG")


def test_a_timeline_needs_ranks(tmp_path, capsys):
    argv = ["render", "deep-mlp", "--batch", "16", "--timeline", "-o", str(tmp_path / "t.png")]
    assert main(argv) == 2
    assert "--timeline draws a plan's step: give --ranks R too" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_a_timeline_past_what_the_simulator_walks_is_refused(tmp_path, capsys, monkeypatch):
    """The timeline's simulator walks every rank's program: a step past
    `SIMULATE_MAX_WORK` rank-task pairs (here made small) gets one line and no file."""
    graph = load_network("deep-mlp").lower(batch=16)
    monkeypatch.setattr(prediction, "SIMULATE_MAX_WORK", 2 * len(graph.tasks) - 1)
    out = tmp_path / "t.png"
    argv = ["render", "deep-mlp", "--batch", "16", "--ranks", "2", "--timeline", "-o", str(out)]
    assert main(argv) == 2
    assert "more than the step simulator draws" in capsys.readouterr().err
    assert not out.exists()


def test_auto_in_stages_takes_the_split_of_least_predicted_step():
    """On a slow link, 2 stages of 2 ranks each: data parallelism inside the stages all-reduces
    half the MLP's weights, model parallelism moves activations; auto takes the least step of
    the families and of the mixture taking each layer's cheapest, which here is the mixture."""
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=32), 2, 4)
    machine = Machine(link_gbytes_per_s=0.1, latency_us=50)
    model = StepModel(machine)
    chosen, why = resolve_strategy(graph, "auto", 4, machine, 10.0, step=model.step)
    assert why is None and set(chosen.unit_ranks.values()) == {0, 2}  # 2 stages of 2 ranks
    uniform = {f: builtin(graph, f, 4) for f in BUILTIN}
    steps = {f: model.step(graph, build_plan(graph, s, 4)) for f, s in uniform.items()}
    assert model.step(graph, build_plan(graph, chosen, 4)) < min(steps.values())
    for unit, grid in chosen.unit_grids.items():
        assert grid in {s.unit_grids[unit] for s in uniform.values()}, unit
    assert all(chosen.unit_grids != s.unit_grids for s in uniform.values())


def _auto_in_stages_shared(folder) -> None:
    import multiprocessing
    import os

    from partitioner import resolve
    from runtime.step import model as step_model

    # the steps compared are sums, as beyond the ranks a step is simulated on
    step_model.objective_simulates = lambda graph, nranks: False
    graph, _ = pipelined(load_network("deep-mlp").lower(batch=32), 2, 4)
    machine = Machine(link_gbytes_per_s=0.1, latency_us=50)
    alone = StepModel(machine)
    by_step, _ = resolve_strategy(graph, "auto", 4, machine, 10.0, step=alone.step)
    by_sum, _ = resolve_strategy(
        graph, "auto", 4, machine, 10.0, step=alone.step, sums=alone.step_is_sum
    )
    costs = resolve.task_costs

    def pricing(graph, plan, machine):
        (folder / f"{os.getpid()}-{plan.strategy}").touch()
        return costs(graph, plan, machine)

    resolve.task_costs = pricing
    ahead = StepModel(machine)
    with ahead.looking_ahead(workers=1):
        shared, _ = resolve_strategy(graph, "auto", 4, machine, 10.0, step=ahead.step,
                                     sums=ahead.step_is_sum, share=ahead.share_out)  # fmt: skip
    assert multiprocessing.active_children() == []
    assert shared == by_sum == by_step
    priced = [name.split("-") for name in os.listdir(folder)]
    assert sorted(family for _, family in priced) == sorted([*BUILTIN, "auto"])  # once each
    assert len({pid for pid, _ in priced}) == 2  # here and in a forked process


def test_auto_in_stages_prices_the_built_ins_at_once_on_idle_cores(tmp_path):
    """Where the steps compared are sums, `auto` in a pipeline's stages needs the built-ins'
    plans for their rows alone, and prices them on the cores `partition` has idle: the same
    choice as one process makes, by sums or by steps, each plan priced once."""
    in_fresh_process(_auto_in_stages_shared, tmp_path)


@pytest.mark.parametrize(
    ("stages", "count", "strategy", "nranks"), [(2, 4, "data", 2), (2, 8, "model", 4)]
)
def test_a_simulated_step_is_computing_or_waiting(stages, count, strategy, nranks):
    """`compute_fraction` (each rank's kernels) and the bubble (its waits) share the simulated
    step between them, all but the posting and packing, which this machine prices in
    microseconds; one rank alone, with no overhead to pay, only computes."""
    machine = Machine(
        rank_gflops=50.0, link_gbytes_per_s=0.125, latency_us=60.0, rank_memory_gib=12.0
    )
    graph, _ = pipelined(small_network().lower(16), stages, count)
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    found = StepModel(machine).step_prediction(graph, plan, 0.0)
    assert 0 < found["compute_fraction"] < 1
    assert 0.98 < found["compute_fraction"] + found["bubble_fraction"] <= 1 + 1e-12
    alone = small_network().lower(16)
    plan = build_plan(alone, builtin(alone, "data", 1), 1)
    assert StepModel(machine).step_prediction(alone, plan, 0.0)[
        "compute_fraction"
    ] == pytest.approx(1.0)
