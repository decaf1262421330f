"""`--stages auto` (`partitioner.search.stages`): stages, micro-batches and cuts by prediction.

The cuts' DP is checked against a brute force over every cut, with each layer's weight and each
cut's crossing cost; the bytes a cut is charged are what the planner sends across it; the
choice is the least predicted of the plans tried, the unstaged step included, so a pipeline is
chosen on a slow link and not on one rank; and what `partition --stages auto` reports is the
chosen plan's prediction, which `train --stages auto` then runs, equal to one process.
"""

from __future__ import annotations

import io
import json
import random
from itertools import combinations, pairwise

import numpy as np
import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.micro_batches import schedule_of, stages_of
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.spec import network_from_dict
from partitioner.machine import Machine
from partitioner.pipeline import (
    cuts_naming,
    cuts_of,
    pipelined,
    stage_cuts,
    staged_units,
    stages_at,
)
from partitioner.plan import build_plan
from partitioner.resolve import resolve_stages, strategy_chooser
from partitioner.search.stages import AUTO_SCHEDULES, AUTO_STAGES, _crossing_bytes, stage_counts
from partitioner.strategy import builtin
from runtime.distributed import RunOptions, train_rank
from runtime.step import model as step_model
from runtime.step import prediction
from runtime.step.model import StepModel
from runtime.transport import run_threads
from tests.fresh_process import in_fresh_process
from tests.partitioner.test_pipeline import residual_network
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

#: a link slow enough that summing an MLP's weight gradients costs more than its activations
SLOW = Machine(link_gbytes_per_s=0.01, latency_us=50)


def mlp_spec(width: int = 96, depth: int = 4) -> dict:
    layers = []
    for i in range(depth):
        layers += [{"kind": "linear", "name": f"fc{i}", "out": width},
                   {"kind": "filterNL", "fn": "relu"}]  # fmt: skip
    layers += [{"kind": "linear", "name": "out", "out": 4}, {"kind": "softmax"},
               {"kind": "evaluate"}]  # fmt: skip
    return {"name": "mlp", "input": [12, 1, 1], "classes": 4, "layers": layers}


def mlp(width: int = 96, depth: int = 4) -> Network:
    return network_from_dict(mlp_spec(width, depth), "mlp")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_weighted_cuts_make_the_heaviest_stage_lightest(stages):
    graph = mlp(depth=6).lower(batch=8)
    count = len(staged_units(graph))
    rng = random.Random(stages)
    work = [rng.uniform(0.1, 1.0) for _ in range(count)]
    boundary = [rng.uniform(0.0, 0.5) for _ in range(count + 1)]
    of_unit = stage_cuts(graph, stages, work, boundary)

    def heaviest(bounds):
        edges = (0, *bounds, count)
        return max(
            sum(work[a:b]) + (boundary[a] if a else 0.0) + (boundary[b] if b < count else 0.0)
            for a, b in pairwise(edges)
        )

    names = [u.name for u in staged_units(graph)]
    found = [names.index(c) for c in cuts_of(of_unit)]
    assert len(found) == stages - 1
    best = min(heaviest(b) for b in combinations(range(1, count), stages - 1))
    assert heaviest(found) == pytest.approx(best, rel=1e-12)
    assert stages_at(graph, cuts_of(of_unit)) == of_unit


def test_a_pipeline_cut_where_asked_is_cut_there():
    graph = mlp(depth=6).lower(batch=8)
    step, of_unit = pipelined(graph, 3, 3, cuts=["fc1", "fc4"])
    assert cuts_of(of_unit) == ("fc1", "fc4")
    stages = [of_unit[u.name] for u in staged_units(graph)]
    assert stages == [0, 1, 1, 1] + [2] * (len(stages) - 4)
    forward = {t.attrs["stage"] for t in step.tasks if t.phase == "forward" and "fc0" in t.name}
    assert forward == {0}


@pytest.mark.parametrize(
    ("stages", "cuts", "message"),
    [
        (2, ["fc9"], "stage cut at 'fc9': not a layer"),
        (3, ["fc3", "fc1"], "each names the first layer of a stage after the first"),
        (2, ["fc0"], "each names the first layer of a stage after the first"),
        (3, ["fc1"], "3 stages need 2 cuts, got 1"),
    ],
)
def test_bad_cuts_are_named(stages, cuts, message):
    with pytest.raises(LegionNNError, match=message):
        pipelined(mlp(depth=6).lower(batch=8), stages, 2, cuts=cuts)


def test_a_cut_is_charged_what_the_planner_sends_across_it():
    """On 2 ranks, a rank per stage, one micro-batch: the forward copies from stage 0 to stage 1
    are exactly the activations written before the cut and read after it (the skip connection
    included where the cut falls inside the block)."""
    graph = residual_network().lower(batch=4, dtype="float64")
    names = [u.name for u in staged_units(graph)]
    crossing = _crossing_bytes(graph, staged_units(graph))
    for position in range(1, len(names)):
        step, _ = pipelined(graph, 2, 1, cuts=[names[position]])
        assert stages_of(step) == 2  # one micro-batch, still in two stages
        plan = build_plan(step, builtin(step, "data", 2), 2)
        sent = sum(
            t.nbytes * len(t.dsts)
            for task, task_plan in zip(step.tasks, plan.tasks, strict=True)
            if task.phase == "forward"
            for t in task_plan.transfers
            if not t.reduce and t.src == 0 and 1 in t.dsts
        )
        assert sent == crossing[position], names[position]
    assert crossing[names.index("C")] > crossing[names.index("B")]  # A's output rides along


def _search(machine, nranks, strategy="data", micro_batches=None, schedule="1f1b", sums=None):
    """`--stages auto` as the commands run it, or, with `sums`, comparing the candidates by
    their sums where it says so (and then by nothing else)."""
    graph = mlp().lower(batch=16)
    model = StepModel(machine)
    compared = model.compared_steps if sums is None else None
    return resolve_stages(
        graph, strategy, nranks, machine, 10.0, schedule, micro_batches, None, None,
        model.peak, model.step, None, sums, compared=compared,
    )  # fmt: skip


def test_without_a_schedule_each_pipeline_is_predicted_under_both():
    """The MLP's linear layers can defer their weight gradients: every staged candidate the
    prediction sees is tried with and without, and the least predicted runs."""
    step, strategy, _, search = _search(SLOW, 2, schedule=None)
    predicted = [c for c in search.tried if c.predicted is not None]
    staged = {c.key[:3] for c in predicted if c.stages > 1}
    assert staged and {c.schedule for c in predicted if c.stages > 1} == set(AUTO_SCHEDULES)
    assert all(
        (*shape, s) in {c.key for c in predicted} for shape in staged for s in AUTO_SCHEDULES
    )
    assert search.chosen.predicted == min(c.predicted for c in predicted)
    assert schedule_of(step) == (search.chosen.micro_batches, search.chosen.schedule)
    model = StepModel(SLOW)
    assert model.step(step, build_plan(step, strategy, 2)) == search.chosen.predicted
    # a schedule given is the only one tried
    _, _, _, given = _search(SLOW, 2, schedule="gpipe")
    assert {c.schedule for c in given.tried} == {"gpipe"}


def _shared_search(folder) -> tuple:
    """`_search` with the candidates shared out over this process and a forked one (a process
    without other threads: `tests.fresh_process`), each recording its process id."""
    import os

    graph = mlp().lower(batch=16)
    model = StepModel(SLOW)
    compared = model.compared_steps

    def comparing(*args):
        (folder / str(os.getpid())).touch()
        return compared(*args)

    with model.looking_ahead(workers=1):
        found = resolve_stages(
            graph, "data", 2, SLOW, 10.0, None, None, None, None, model.peak, model.step, None,
            None, model.share_out, comparing,
        )  # fmt: skip
    ran_in = {int(p.name) for p in folder.iterdir()}
    return found[1], found[3], len(ran_in), os.getpid() in ran_in


def test_the_candidates_shared_out_over_the_cores_are_predicted_as_one_process_does(tmp_path):
    """`--stages auto` predicts its candidates on every core at once (`StepModel.share_out`):
    the same predictions, the same pipeline and grids chosen as one after another."""
    _, strategy, _, search = _search(SLOW, 2, schedule=None)
    shared_strategy, shared, processes, here = in_fresh_process(_shared_search, tmp_path)
    assert processes == 2 and here
    assert [(c.key, c.predicted) for c in shared.tried] == [
        (c.key, c.predicted) for c in search.tried
    ]
    assert shared.chosen == search.chosen and shared_strategy == strategy


def test_where_the_steps_are_summed_each_pipeline_is_predicted_under_one_schedule():
    """A bulk-synchronous sum counts a step's work, not the bubbles or the order its schedule
    gives it: each staged candidate is summed once, under the first of `AUTO_SCHEDULES`."""
    _, _, _, search = _search(SLOW, 2, schedule=None, sums=lambda graph, nranks: True)
    predicted = [c for c in search.tried if c.predicted is not None]
    staged = [c.key[:3] for c in predicted if c.stages > 1]
    assert staged and len(staged) == len(set(staged))
    assert {c.schedule for c in predicted} == {AUTO_SCHEDULES[0]}
    assert search.chosen.predicted == min(c.predicted for c in predicted)


def test_the_least_predicted_is_chosen_and_on_a_slow_link_it_is_a_pipeline():
    step, strategy, _, search = _search(SLOW, 2)
    predicted = [c for c in search.tried if c.predicted is not None]
    assert predicted[0].stages == 1  # the step without stages is always predicted
    assert search.chosen.predicted == min(c.predicted for c in predicted)
    assert search.chosen.stages == 2 and stages_of(step) == 2
    assert schedule_of(step) == (search.chosen.micro_batches, "1f1b")
    assert set(strategy.unit_ranks.values()) == {0, 1}
    model = StepModel(SLOW)
    assert model.step(step, build_plan(step, strategy, 2)) == search.chosen.predicted


def test_one_rank_has_no_stages_to_choose():
    assert stage_counts(mlp().lower(batch=16), 1) == [1]
    step, _, _, search = _search(SLOW, 1, micro_batches=2)
    assert search.chosen.stages == 1 and schedule_of(step) == (2, "1f1b")


def _stages_auto_report(tmp_path) -> tuple[dict, list[dict]]:
    """`partition deep-mlp --stages auto` on 2 ranks of the slow machine: the report and its
    candidates that were predicted."""
    machine = tmp_path / "slow.json"
    machine.write_text(json.dumps(SLOW.to_json()))
    out = tmp_path / "p.json"
    argv = ["partition", "deep-mlp", "--ranks", "2", "--batch", "16", "--stages", "auto",
            "--strategy", "data", "--machine", str(machine), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    return report, [r for r in report["pipeline_search"] if r["predicted_seconds"] is not None]


def test_partition_reports_the_chosen_pipelines_prediction(tmp_path):
    report, rows = _stages_auto_report(tmp_path)
    best = min(rows, key=lambda r: r["predicted_seconds"])
    assert report["predicted_step_seconds"] == best["predicted_seconds"]
    assert len(report["stages"]) == best["stages"] == 2
    assert report["micro_batches"] == best["micro_batches"]
    assert report["schedule"] == best["schedule"]
    assert report["stages"][1]["layers"][0] == best["cuts"][0]
    # each candidate tried says how it was predicted: on 2 ranks, simulated
    assert {r["step_model"] for r in rows} == {"simulated"}


def test_candidates_compared_by_their_sums_say_so(tmp_path, capsys, monkeypatch):
    """Where `auto` compares steps by their sums (every rank's programs past the work a
    simulation builds, `prediction.objective_simulates`, here made 1 pair) and a candidate's
    programs, one per class of ranks alike, are past `SIMULATE_MAX_WORK` (here made 1 pair),
    each candidate tried is reported as summed, in the JSON and the table, while the step
    reported of the one chosen is simulated."""
    monkeypatch.setattr(prediction, "SIMULATE_MAX_WORK", 1)
    monkeypatch.setattr(step_model, "SIMULATE_MAX_WORK", 1)
    report, rows = _stages_auto_report(tmp_path)
    assert rows and {r["step_model"] for r in rows} == {"bulk-synchronous"}
    assert report["step_model"] == "simulated"
    assert "s predicted, summed" in capsys.readouterr().out


def test_candidates_built_by_class_are_compared_simulated_on_any_number_of_ranks(
    tmp_path, monkeypatch
):
    """Where `auto` compares steps by their sums (every rank's programs past the work a
    simulation builds, here made 1 pair), candidates whose programs are built one per class of
    ranks alike within `SIMULATE_MAX_WORK` (data parallelism in each stage) are compared by
    their simulated steps, not by sums that count a pipeline's stages one after another: each
    the step simulated where every step is, and the least chosen."""
    _, everywhere = _stages_auto_report(tmp_path)
    simulated = {_row_key(r): r["predicted_seconds"] for r in everywhere}
    monkeypatch.setattr(prediction, "SIMULATE_MAX_WORK", 1)
    (tmp_path / "beyond").mkdir()
    report, rows = _stages_auto_report(tmp_path / "beyond")
    assert {r["step_model"] for r in rows} == {"simulated"}
    assert any(r["stages"] > 1 for r in rows)
    # each pipeline under both schedules, as where every step is simulated
    assert {_row_key(r): r["predicted_seconds"] for r in rows} == simulated
    assert report["predicted_step_seconds"] == min(r["predicted_seconds"] for r in rows)


def _row_key(row: dict) -> tuple:
    return row["stages"], row["micro_batches"], tuple(row["cuts"]), row["schedule"]


def test_train_with_stages_auto_runs_the_chosen_pipeline_equal_to_one_process():
    network = mlp()
    full = local_run(config(network, batch=8), steps=2)
    cfg = config(
        network, batch=8, steps=2, epochs=1, stages=AUTO_STAGES, micro_batches=None, schedule=None
    )
    options = RunOptions(strategy="data", machine=SLOW)
    log = io.StringIO()
    results = run_threads(2, lambda transport: train_rank(cfg, transport, options, log=log))
    np.testing.assert_allclose(results[0].losses, full[0], rtol=1e-9, atol=0)
    chosen = [json.loads(line) for line in log.getvalue().splitlines() if "pipeline" in line]
    assert chosen[0]["stages"] == 2 and chosen[0]["schedule"] in AUTO_SCHEDULES


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["graph", "deep-mlp", "--stages", "auto"], "--stages auto chooses stages for a count"),
        (
            [
                "partition",
                "deep-mlp",
                "--ranks",
                "2",
                "--batch",
                "16",
                "--stages",
                "auto",
                "--micro-batches",
                "17",
            ],
            "--micro-batches 17 is larger than the batch of 16 samples",
        ),
        (
            ["partition", "deep-mlp", "--ranks", "2", "--stages", "auto", "--micro-batches", "0"],
            "--micro-batches must be at least 1",
        ),
        (
            [
                "partition",
                "deep-mlp",
                "--ranks",
                "2",
                "--stages",
                "auto",
                "--strategy",
                "examples/megatron-col-row-2.json",
            ],
            "a grids file fixes its grids' ranks",
        ),
    ],
)
def test_bad_stages_auto_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_stages_neither_a_count_nor_auto_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["graph", "deep-mlp", "--stages", "two"])
    assert exc.value.code == 2
    assert "a count of stages or auto, not 'two'" in capsys.readouterr().err


def _grids_file(tmp_path, stages, grids) -> str:
    path = tmp_path / "staged.json"
    path.write_text(json.dumps({"stages": stages, "grids": grids}))
    return str(path)


#: the MLP's layers in 2 stages, each layer's grid over its stage's 2 ranks
STAGES = [["fc0", "fc1"], ["fc2", "fc3", "out.linear5", "out.softmax"]]
GRIDS = {"fc0": [1, 2, 1, 1], "fc1": [2, 1, 1, 1], "fc2": [2, 1, 1, 1], "fc3": [1, 2, 1, 1],
         "out.linear5": [2, 1, 1, 1, 1, 1, 1], "out.softmax": [2, 1, 1, 1],
         "out.evaluate.accuracy": [1]}  # fmt: skip


def test_a_grids_file_names_stages_and_its_grids_cut_each_over_its_stages_ranks(tmp_path):
    """4 ranks in the file's 2 stages, column and row splits mixed: one process's step."""
    network = mlp()
    path = _grids_file(tmp_path, STAGES, GRIDS)
    cuts = cuts_naming(network.lower(batch=8), STAGES, path)
    assert cuts == ("fc2",)
    full = local_run(config(network, batch=8))
    cfg = config(network, batch=8, stages=2, micro_batches=4, cuts=cuts)
    assert_same(full, ranks_run(cfg, 4, strategy_chooser(path, Machine(), 1.0)))


def test_partition_takes_the_stages_a_grids_file_names(tmp_path):
    grids = {u.name: [2, 1, 1, 1] for u in staged_units(load_network("deep-mlp").lower(batch=8))}
    grids["classifier.linear9"] = [2, 1, 1, 1, 1, 1, 1]
    grids["classifier.evaluate.accuracy"] = [1]
    stages = [{"layers": ["fc1", "fc2", "fc3"]},
              {"layers": ["fc4", "fc5", "fc6", "fc7", "fc8", "classifier.linear9",
                          "classifier.softmax"]}]  # fmt: skip
    path = _grids_file(tmp_path, stages, grids)
    out = tmp_path / "p.json"
    argv = ["partition", "deep-mlp", "--ranks", "4", "--batch", "16", "--strategy", path,
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["stages"] == [s | {"ranks": r} for s, r in zip(stages, ([0, 1], [2, 3]))]
    assert report["micro_batches"] == 4


@pytest.mark.parametrize(
    ("stages", "extra", "message"),
    [
        (
            [["fc0"], ["fc2", "fc3", "out.linear5", "out.softmax"]],
            [],
            "the stages leave out layer 'fc1'",
        ),
        ([["fc0", "fc1"], ["fc9"]], [], "stage layer 'fc9' is not a layer"),
        (
            [["fc1", "fc0"], ["fc2", "fc3", "out.linear5", "out.softmax"]],
            [],
            "in their order, each once",
        ),
        ([["fc0", "fc1"], [], ["fc2", "fc3", "out.linear5", "out.softmax"]], [], "none empty"),
        (STAGES, ["--stages", "3"], "--stages 3: "),
        ("fc0", [], '"stages" is a list of stages'),
    ],
)
def test_bad_stages_in_a_grids_file_are_one_line(tmp_path, capsys, stages, extra, message):
    spec = tmp_path / "mlp.json"
    spec.write_text(json.dumps(mlp_spec()))
    path = _grids_file(tmp_path, stages, GRIDS)
    out = tmp_path / "p.json"
    argv = ["partition", str(spec), "--ranks", "4", "--batch", "8", "--strategy", path,
            "--json", str(out), *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
