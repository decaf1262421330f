"""`auto` optimises what `partition` reports: the simulated step, not the search's sum."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.main import main
from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.search.memory_fit import STEP_WITHIN
from partitioner.strategy import BUILTIN, builtin, with_homes
from runtime.step.model import StepModel
from tests.fresh_process import in_fresh_process
from tests.plan_cases import networks, strategies

SLOW = Machine(rank_gflops=20, link_gbytes_per_s=0.1, latency_us=50, memory_gbytes_per_s=20,
               task_overhead_us=30, message_overhead_us=100)  # fmt: skip
FAST = Machine(rank_gflops=20, link_gbytes_per_s=5, latency_us=5)
CASES = [
    ("seed-lcn-small", 64, 2, SLOW),
    ("seed-lcn-small", 32, 4, FAST),
    ("deep-mlp", 32, 2, SLOW),
    ("three-layer-convnet", 16, 2, FAST),
]


@pytest.mark.parametrize("network,batch,ranks,machine", CASES)
@pytest.mark.parametrize("with_peak", [False, True], ids=["homes-given", "memory-fit"])
def test_no_built_in_plan_near_autos_is_predicted_faster(network, batch, ranks, machine,
                                                         with_peak):  # fmt: skip
    graph = load_network(network).lower(batch=batch, optimizer="sgd")
    step = StepModel(machine).step
    peak = StepModel(machine).peak if with_peak else None
    chosen, _ = resolve_strategy(graph, "auto", ranks, machine, 10.0, peak=peak, step=step)
    plan = build_plan(graph, chosen, ranks)
    mine = step(graph, plan)
    bulk = plan_cost(graph, plan, machine).step_seconds
    for family in BUILTIN:
        other = build_plan(graph, builtin(graph, family, ranks), ranks)
        other_bulk = plan_cost(graph, other, machine).step_seconds
        if other_bulk <= bulk * STEP_WITHIN:
            assert mine <= step(graph, other) * (1 + 1e-12), family


def test_auto_chooses_by_the_simulated_step_where_the_sum_would_choose_otherwise():
    """seed-lcn-small at batch 512 on 8 ranks and a slow link: the search's sum prefers grids
    whose step simulates slower than data parallelism's, whose all-reduces hide under the
    backward pass; auto with the simulated step takes the faster plan. (On 4 ranks the two are
    within 3% since the accuracy task left the forward pass, where rank 0 waited for every
    rank's statistics before its backward; at 50 MB/s and 30 µs 1.4% apart since all-reduces
    over 8 ranks halve and double, 2.7% before; 8.5% at 30 MB/s and 10 µs.)"""
    machine = Machine(rank_gflops=50, link_gbytes_per_s=0.03, latency_us=10)
    graph = load_network("seed-lcn-small").lower(batch=512, optimizer="sgd")
    step = StepModel(machine).step
    data = step(graph, build_plan(graph, builtin(graph, "data", 8), 8))
    searched, _ = resolve_strategy(graph, "auto", 8, machine, 10.0)
    assert step(graph, build_plan(graph, searched, 8)) > data * 1.02  # the sum alone loses
    chosen, _ = resolve_strategy(graph, "auto", 8, machine, 10.0, step=step)
    assert step(graph, build_plan(graph, chosen, 8)) <= data * (1 + 1e-12)


@pytest.mark.parametrize("ranks", [2, 128])
def test_partition_reports_the_step_auto_chose_by(tmp_path, ranks):
    """On 2 ranks and on 128, past the 64 whose buffers a report places: every plan compared
    is simulated, and the report is the step of the plan chosen."""
    machine_file = tmp_path / "machine.json"
    machine_file.write_text(json.dumps(SLOW.to_json()))
    report = tmp_path / "p.json"
    batch = max(64, ranks)
    argv = ["partition", "seed-lcn-small", "--batch", str(batch), "--ranks", str(ranks),
            "--strategy", "auto", "--optimizer", "sgd", "--machine", str(machine_file),
            "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    reported = json.loads(report.read_text())
    graph = load_network("seed-lcn-small").lower(batch=batch, optimizer="sgd")
    model = StepModel(SLOW)
    assert not model.step_is_sum(graph, ranks) and reported["step_model"] == "simulated"
    chosen, _ = resolve_strategy(graph, "auto", ranks, SLOW, 30.0, peak=model.peak,
                                 step=model.step)  # fmt: skip
    step = StepModel(SLOW).step(graph, build_plan(graph, chosen, ranks))
    assert reported["predicted_step_seconds"] == pytest.approx(step)


def test_the_step_model_derives_each_plan_once_and_predicts_as_the_functions_do(monkeypatch):
    """auto's fit and comparison and the report of the plan it picks share one model: the
    picked plan is the one the fit built, its programs are built once (the fit's placement of
    its buffers reads them too, not a few ranks' built apart), and every prediction equals the
    one made from scratch."""
    from runtime.step import model as step_model
    from runtime.step import rank_memory as step_memory
    from runtime.step.programs import build_programs
    from runtime.step.rank_memory import memory_prediction, plan_peak

    built: list[tuple] = []

    def counting(graph, plan, machine, ranks, *args, **kwargs):
        built.append((plan.strategy, sorted(plan.unit_grids.items()), plan.sharded))
        return build_programs(graph, plan, machine, ranks, *args, **kwargs)

    monkeypatch.setattr(step_model, "build_programs", counting)
    monkeypatch.setattr(step_memory, "build_programs", counting)
    graph = load_network("seed-lcn-small").lower(batch=64, optimizer="sgd")
    model = StepModel(SLOW)
    chosen, _ = resolve_strategy(graph, "auto", 2, SLOW, 10.0, peak=model.peak, step=model.step,
                                 lower=model.step_lower_bound)  # fmt: skip
    compared = len(built)
    plan = model.plan(graph, chosen, 2)
    bulk = plan_cost(graph, plan, SLOW).step_seconds
    report = (model.step_prediction(graph, plan, bulk), model.memory_prediction(graph, plan))
    assert compared >= 2 and len(built) == compared  # the report builds nothing again
    assert all(built.count(key) == 1 for key in built)
    fresh = build_plan(graph, chosen, 2)
    assert report == (
        StepModel(SLOW).step_prediction(graph, fresh, bulk),
        memory_prediction(graph, fresh, SLOW),
    )
    assert model.peak(graph, plan) == plan_peak(graph, fresh, SLOW)


def test_on_more_ranks_than_it_simulates_the_model_keeps_the_plans_it_was_asked_about(
    monkeypatch,
):
    """Where plans are compared by their sums (every rank's programs past `SIMULATE_MAX_WORK`)
    no programs are built, and the plan the command reports is the one the fit planned:
    `StepModel.plan` does not plan it again."""
    from runtime.step import model as step_model

    ranks = 2048
    graph = load_network("seed-lcn-small").lower(batch=ranks, optimizer="sgd")
    model = StepModel(SLOW)
    assert model.step_is_sum(graph, ranks)
    chosen, _ = resolve_strategy(graph, "auto", ranks, SLOW, 10.0, peak=model.peak,
                                 step=model.step)  # fmt: skip
    planned: list[str] = []

    def counting(graph, strategy, nranks):
        planned.append(strategy.name)
        return build_plan(graph, strategy, nranks)

    monkeypatch.setattr(step_model, "build_plan", counting)
    plan = model.plan(graph, chosen, ranks)
    assert planned == [] and plan.unit_grids == chosen.unit_grids
    other = replace(builtin(graph, "data", ranks), name="custom")  # not one the fit tried
    model.plan(graph, other, ranks)
    assert planned == ["custom"]  # a plan it was never asked about is planned


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(),
    nranks=st.sampled_from([1, 2, 3, 4]),
    machine=st.sampled_from([FAST, SLOW]),
    homes=st.sampled_from(["replicated", "sharded"]),
    data=st.data(),
)
def test_the_step_bound_is_below_every_simulated_step(graph, nranks, machine, homes, data):
    """`StepModel.step_lower_bound`, found without a rank's program, is below the step the
    model predicts, on random plans with either homes (it leaves out what homes change)."""
    strategy = with_homes(graph, data.draw(strategies(graph, nranks)), homes)
    plan = build_plan(graph, strategy, nranks)
    model = StepModel(machine)
    assert model.step_lower_bound(graph, plan) <= model.step(graph, plan)


def test_a_machine_that_times_pieces_gives_no_bound():
    """Its tasks may run in modes timed below the rows the bound adds up."""
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    timed = replace(FAST, pieces={("whatever",): 1e-3})
    assert StepModel(FAST).step_lower_bound(graph, plan) > 0
    assert StepModel(timed).step_lower_bound(graph, plan) is None


@pytest.mark.parametrize("network,batch,ranks,machine", [*CASES, ("seed-lcn", 16, 4, FAST)])
def test_the_fit_leaves_out_plans_that_cannot_be_fastest_and_chooses_the_same(
    network, batch, ranks, machine
):
    """With the bound, the fit places no plan whose step is surely longer than the searched
    grids' (seed-lcn at batch 16 on 4 ranks: spatial cuts, whose busiest rank computes longer
    than auto's whole step) and picks what it picks without it."""
    graph = load_network(network).lower(batch=batch, optimizer="sgd")
    chosen, placed = [], []
    for lower in (False, True):
        model = StepModel(machine)
        plans = []

        def peak(graph, plan, model=model, plans=plans):
            plans.append(plan.strategy)
            return model.peak(graph, plan)

        bound = model.step_lower_bound if lower else None
        found, _ = resolve_strategy(graph, "auto", ranks, machine, 10.0, None, None, peak,
                                    model.step, bound)  # fmt: skip
        chosen.append((found.unit_grids, found.sharded))
        placed.append(plans)
    assert chosen[0] == chosen[1]
    assert set(placed[1]) <= set(placed[0])
    if network == "seed-lcn":
        assert len(placed[1]) < len(placed[0])


def test_beyond_the_ranks_simulated_auto_returns_the_searchs_least_sum_without_planning_others(
    monkeypatch,
):
    """On 1024 ranks (every rank's programs past `SIMULATE_MAX_WORK`) `step` is the
    bulk-synchronous sum, which the search's DP adds up exactly and has proved least over every
    assignment of grids (the built-ins' too): with `sums` the search's grids are returned as
    they fit, the built-ins never planned (deep-mlp at batch 1024 on a fast link), the same
    strategy as fitting every candidate gives."""
    from partitioner import resolve

    machine = Machine(rank_gflops=20, link_gbytes_per_s=5, latency_us=5)
    graph = load_network("deep-mlp").lower(batch=1024, optimizer="sgd")
    model = StepModel(machine)
    assert model.step_is_sum(graph, 1024) and not model.step_is_sum(graph, 128)
    fitted, _ = resolve_strategy(
        graph, "auto", 1024, machine, 10.0, peak=model.peak, step=model.step,
        lower=model.step_lower_bound,
    )  # fmt: skip
    planned = []
    plan_of = resolve.build_plan

    def counted(graph, strategy, nranks, **options):
        planned.append(strategy.name)
        return plan_of(graph, strategy, nranks, **options)

    monkeypatch.setattr(resolve, "build_plan", counted)
    monkeypatch.setattr("partitioner.search.memory_fit.build_plan", counted)
    quick, _ = resolve_strategy(
        graph, "auto", 1024, StepModel(machine).machine, 10.0, peak=model.peak, step=model.step,
        lower=model.step_lower_bound, sums=model.step_is_sum,
    )  # fmt: skip
    assert quick.unit_grids == fitted.unit_grids and quick.sharded == fitted.sharded
    assert planned == ["auto"]


# the next two run their bodies in a spawned interpreter (`tests.fresh_process`): the model
# forks only from a process with no other thread, which this test worker may not be


def _built_ins_worked_out_ahead(
    network: str, batch: int, ranks: int, machine: Machine, simulated: bool = True
) -> None:
    import multiprocessing

    from runtime.step import model as step_model

    if not simulated:  # as where the programs are past what a simulation builds
        step_model.objective_simulates = lambda graph, nranks: False
    graph = load_network(network).lower(batch=batch, optimizer="sgd")
    alone = StepModel(machine)
    expected = resolve_strategy(graph, "auto", ranks, machine, 10.0, peak=alone.peak,
                                step=alone.step, lower=alone.step_lower_bound)  # fmt: skip
    ahead = StepModel(machine)
    with ahead.looking_ahead(workers=1):
        chosen = resolve_strategy(graph, "auto", ranks, machine, 10.0, peak=ahead.peak,
                                  step=ahead.step, lower=ahead.step_lower_bound,
                                  foresee=ahead.foresee)  # fmt: skip
    assert multiprocessing.active_children() == []
    assert chosen == expected
    assert ahead.foreseen  # some built-in was asked for, and a process had worked it out
    if not simulated:  # a search that proves its sum the least is placed ahead and reported
        summed = StepModel(machine)
        with summed.looking_ahead(workers=1):
            assert expected == resolve_strategy(
                graph, "auto", ranks, machine, 10.0, peak=summed.peak, step=summed.step,
                lower=summed.step_lower_bound, sums=summed.step_is_sum, foresee=summed.foresee,
            )  # fmt: skip
        assert multiprocessing.active_children() == []
    for family in BUILTIN:
        plan = build_plan(graph, builtin(graph, family, ranks), ranks)
        if family in ahead.foreseen:
            assert ahead.peak(graph, plan) == alone.peak(graph, plan)
            assert ahead.step(graph, plan) == alone.step(graph, plan)


@pytest.mark.parametrize("network,batch,ranks,machine", CASES[1:2] + CASES[3:])
def test_the_built_ins_worked_out_ahead_give_auto_what_it_would_find_itself(
    network, batch, ranks, machine
):
    """`partition` lets idle cores work out the built-ins' plans while auto searches: auto
    chooses the same plan, from the same values, which forked processes found."""
    in_fresh_process(_built_ins_worked_out_ahead, network, batch, ranks, machine)


def test_the_built_ins_memory_worked_out_ahead_where_steps_are_summed():
    """Where auto compares plans by their sums, their placed memory is still worth a process
    (up to `PLACED_MAX_RANKS` ranks): the same plan chosen, from the same values."""
    in_fresh_process(_built_ins_worked_out_ahead, *CASES[1], False)


def _memory_placed_ahead(folder: Path, worth_a_process: bool) -> None:
    import multiprocessing
    import os

    from runtime.step import model as step_model

    placed = step_model.memory_prediction

    def placing(*args, **kwargs):
        (folder / str(os.getpid())).touch()
        return placed(*args, **kwargs)

    graph = load_network("seed-lcn-small").lower(batch=32, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, "spatial", 4), 4)
    expected = StepModel(FAST).predictions(graph, plan)
    step_model.memory_prediction = placing
    if worth_a_process:
        step_model.FORK_TO_PLACE = 1
    ahead = StepModel(FAST)
    with ahead.looking_ahead(workers=1):
        got = ahead.predictions(graph, plan)
    assert multiprocessing.active_children() == []
    assert got[1:] == expected[1:]
    assert got[0].tasks == expected[0].tasks and got[0].memory == expected[0].memory
    placed_in = [int(p.name) for p in folder.iterdir()]
    if worth_a_process:
        assert placed_in and os.getpid() not in placed_in
    else:
        assert placed_in == [os.getpid()]


@pytest.mark.parametrize("worth_a_process", [True, False])
def test_a_reports_memory_placed_in_a_forked_process_is_what_this_one_places(
    tmp_path, worth_a_process
):
    """`partition` places the memory of the plan it reports in a forked process while it
    simulates the step: the same predictions, the placing done elsewhere; a plan whose placing
    costs less than a process is placed here."""
    in_fresh_process(_memory_placed_ahead, tmp_path, worth_a_process)


def _memory_placed_in_shares(folder: Path, nranks: int = 4, workers: int = 1) -> None:
    import multiprocessing
    import os

    from runtime.step import model as step_model

    placed = step_model.placed_ranks

    def placing(graph, plan, machine, ranks=None, programs=None):
        (folder / f"{os.getpid()}-{min(ranks)}").touch()
        return placed(graph, plan, machine, ranks, programs)

    graph = load_network("seed-lcn-small").lower(batch=32, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, "spatial", nranks), nranks)
    expected = StepModel(FAST).memory_prediction(graph, plan)
    step_model.placed_ranks = placing
    ahead = StepModel(FAST)
    with ahead.looking_ahead(workers=workers):
        got = ahead.memory_prediction(graph, plan)  # no program built yet: placed in shares
    assert multiprocessing.active_children() == []
    assert got == expected
    by_first_rank = {}
    for name in os.listdir(folder):
        pid, first = name.split("-")
        by_first_rank.setdefault(int(first), []).append(int(pid))
    shares = min(workers + 1, nranks)  # contiguous, of nranks // shares ranks here
    assert sorted(by_first_rank) == list(range(0, nranks, nranks // shares))  # each placed once
    last = max(by_first_rank)
    assert by_first_rank[last] == [os.getpid()]
    assert all(len(pids) == 1 for pids in by_first_rank.values())


def test_a_reports_memory_placed_in_shares_of_ranks_is_what_one_process_places(tmp_path):
    """Where a reported plan's programs are not built (beyond the work a simulation builds),
    `partition` builds and places its ranks in shares, one per core: the same prediction."""
    in_fresh_process(_memory_placed_in_shares, tmp_path)


@pytest.mark.parametrize("nranks, workers", [(1, 1), (2, 3)])
def test_a_plan_of_fewer_ranks_than_processes_is_placed_in_one_share_a_rank(
    tmp_path, nranks, workers
):
    in_fresh_process(_memory_placed_in_shares, tmp_path, nranks, workers)


def _placed_ahead(
    folder: Path, simulated: bool, busy: bool = False, peak_first: bool = False
) -> None:
    import multiprocessing
    import os

    from runtime.step import model as step_model

    if not simulated:  # as where the programs are past what a simulation builds
        step_model.objective_simulates = lambda graph, nranks: False
    graph = load_network("seed-lcn-small").lower(batch=32, optimizer="sgd")
    strategy = builtin(graph, "spatial", 4)
    plan = build_plan(graph, strategy, 4)
    alone = StepModel(FAST)
    expected = (
        alone.step(graph, plan),
        alone.peak(graph, plan),
        alone.memory_prediction(graph, plan),
    )
    placed = step_model.placed_ranks
    command = os.getpid()

    def placing(graph, plan, machine, ranks=None, programs=None):
        built = "built" if programs is not None else "new"
        if ranks and min(ranks) > 0 and os.getpid() == command:
            # the command's own share waits till the forked process has begun the other, which
            # the command would take itself on a machine too loaded to start the process soon
            deadline = time.monotonic() + 60.0
            while not any("-0-" in name for name in os.listdir(folder)):
                assert time.monotonic() < deadline, "the forked process never began its share"
                time.sleep(0.01)
        (folder / f"{os.getpid()}-{min(ranks) if ranks else 0}-{built}").touch()
        return placed(graph, plan, machine, ranks, programs)

    step_model.placed_ranks = placing
    ahead = StepModel(FAST)
    if busy:  # a process is at a job still wanted as the search ends, and idle by the peak
        answers = iter([True])
        ahead._busy = lambda: next(answers, False)
    with ahead.looking_ahead(workers=1):
        ahead.foresee(graph, [], 4, placing=[strategy])
        if simulated and not peak_first:  # the step simulated here while a process places
            step = ahead.step(graph, plan)
        peak = ahead.peak(graph, plan)
        assert ahead.plan(graph, strategy, 4) is plan  # kept for the report: not planned again
        if not simulated or peak_first:
            step = ahead.step(graph, plan)
        got = step, peak, ahead.memory_prediction(graph, plan)
    assert multiprocessing.active_children() == []
    assert got == expected
    placed_in = sorted(name.split("-") for name in os.listdir(folder))
    if simulated and busy and not peak_first:  # in two shares when the peak was asked for
        assert sorted(int(first) for _, first, _ in placed_in) == [0, 2]
        assert {int(pid) for pid, first, _ in placed_in if first == "2"} == {os.getpid()}
        assert len({pid for pid, _, _ in placed_in}) == 2
        # from the programs built here, from which the report simulates the step
        assert {built for _, _, built in placed_in} == {"built"}
    else:  # every rank by a process while this one simulated the step
        assert len(placed_in) == 1 and int(placed_in[0][0]) != os.getpid()
        # placed as the search ended, or as the peak was asked for from the programs built
        # here, whose step this process simulated meanwhile
        assert placed_in[0][2] == ("new" if simulated and not busy else "built")


@pytest.mark.parametrize(
    "simulated, busy, peak_first",
    [(True, False, False), (False, False, False), (True, True, False), (True, True, True)],
)
def test_a_plans_ranks_placed_ahead_give_its_peak_and_memory(tmp_path, simulated, busy, peak_first):
    """Once auto's search is done, `partition` places its grids' every rank ahead: in a forked
    process while it simulates their step where a process is free, else in shares on every
    core as the peak is asked for where the step was simulated before it (from every rank's
    programs built here first, which the report's simulated step reads), else by a forked
    process from those programs while this one simulates the step the report gives, whether or
    not auto compared simulated steps: the same step, peak and memory, each rank placed once."""
    in_fresh_process(_placed_ahead, tmp_path, simulated, busy, peak_first)
