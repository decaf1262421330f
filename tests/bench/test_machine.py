"""`legion-nn bench machine`: the machine file measured under `mpiexec`, read back by
`partition --machine`; and the benchmark commands' bad input.

The emulated cluster's run (a link between hosts, limited to its rate) is in test_cluster.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bench.cache_eviction import cheapest_cold
from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.lowering import OPTIMIZERS
from legion_nn.micro_batches import micro_batched
from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.machine_file import load_machine
from partitioner.piece_times import piece_key, task_piece_times
from partitioner.plan import build_plan
from partitioner.strategy import BUILTIN, PARAM_HOMES, builtin, with_homes
from runtime.step.piece_modes import piece_mode
from runtime.step.programs import build_programs
from tests.paths import ROOT

BATCH = 8


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_bench_machine_under_mpiexec_writes_a_file_partition_prices_from(tmp_path, capsys):
    # each piece's operands flushed where the CPU can: the default eviction writes twice the
    # last-level cache a run (on a 300 MiB L3, 95 of the command's 143 s)
    path = tmp_path / "machine.json"
    command = [
        "mpiexec", "-n", "2", sys.executable, "-m", "cli", "bench", "machine",
        "--network", "seed-lcn-small", "--batch", str(BATCH), "--quick", "--quiet",
        "--eviction", cheapest_cold(), "--json", str(path),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=_environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    assert "2 rank(s) per host" in result.stdout  # rank 0's summary, printed once
    assert result.stdout.count("rank(s) per host") == 1
    data = json.loads(path.read_text())
    assert data["hosts"] == 1 and data["ranks_per_host"] == 2
    assert data["measured_on"]["eviction"] == cheapest_cold()
    assert data["measured_on"]["links_measured"] == ["intra_host"]
    assert {p["pair"] for p in data["pingpong"]} == {"intra_host"}
    assert data["rank_memory_gib"] > 0 and data["rank_cores"] >= 1
    # the calibration's costs, left out where the fit found none (as `Machine.to_json` does)
    assert data["compute_factor"] > 0 and data.get("task_overhead_us", 1.0) > 0
    assert data.get("loop_us", 1.0) > 0
    # a message costs the runtime something beyond the link: posting, polling, completing; far
    # less than a millisecond on one host
    assert 0 < data["message_overhead_us"] < 1000
    # a fresh process of seed-lcn-small's training holds 100-400 MiB beside its buffers
    assert 100 < data["process_baseline_mib"] < 400

    machine = load_machine(str(path))
    assert machine.to_json() == data
    # every piece of the network's fixed plans on 1 and 2 ranks was timed, under every
    # optimizer (a job trains with any of them, and only their updates differ)
    for optimizer in OPTIMIZERS:
        graph = load_network("seed-lcn-small").lower(batch=BATCH, optimizer=optimizer)
        cases = [("data", 1, "replicated")] + [
            (strategy, 2, homes) for strategy in BUILTIN for homes in PARAM_HOMES
        ]
        for strategy, ranks, homes in cases:
            chosen = with_homes(graph, builtin(graph, strategy, ranks), homes)
            plan = build_plan(graph, chosen, ranks)
            times = task_piece_times(graph, plan, machine.pieces)
            missing = [t.name for t, s in zip(graph.tasks, times) if s is None]
            assert not missing, (optimizer, strategy, ranks, homes, missing)
            # and as every rank's program runs them: written, or stepping fused updates
            programs = build_programs(graph, plan, Machine(), range(ranks))
            for rank in programs:
                program = programs[rank]
                modes = [(rt, p, piece_mode(program, rt, p)) for rt in program.tasks if rt.runs
                         for p in rt.pieces]  # fmt: skip
                as_run = [piece_key(rt.task, p.rect.shape, p.requirements, mode)
                          for rt, p, mode in modes if mode is not None]  # fmt: skip
                assert all(key in machine.pieces for key in as_run), (optimizer, strategy)
                if (strategy, ranks) == ("data", 1):
                    assert any("steps" in mode for _, _, mode in modes if mode), optimizer
        # and of micro-batches on a rank of their own: a pipeline stage's (`--quick`: the
        # default pipeline's, 2 stages of 4)
        for count in (4,):
            micro = micro_batched(graph, count)
            times = task_piece_times(micro, build_plan(micro, builtin(micro, "data", 1), 1),
                                     machine.pieces)  # fmt: skip
            assert None not in times, (optimizer, count)
    # an op no key prices runs at the rate of the network's FLOPs, which its filters carry, not
    # at a memory-bound op's
    filters = {rate for key, rate in machine.op_gflops.items() if key.startswith("filter.")}
    assert machine.rank_gflops in filters

    out = tmp_path / "p.json"
    argv = ["partition", "seed-lcn-small", "--batch", str(BATCH), "--ranks", "2"]
    assert main([*argv, "--strategy", "model", "--machine", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"] == data and report["step_model"] == "simulated"
    assert report["predicted_step_seconds"] > machine.loop_seconds
    drawing = tmp_path / "plan.dot"
    argv = ["render", "seed-lcn-small", "--batch", str(BATCH), "--ranks", "2"]
    assert main([*argv, "--strategy", "auto", "--machine", str(path), "-o", str(drawing)]) == 0
    assert "cluster_rank1" in drawing.read_text()
    log = tmp_path / "log.jsonl"
    argv = ["train", "seed-lcn-small", "--data", "synthetic", "--batch", str(BATCH), "--steps", "2"]
    argv += ["--strategy", "auto", "--machine", str(path), "--no-progress", "--log-json", str(log)]
    assert main(argv) == 0
    assert any('"event": "done"' in line for line in log.read_text().splitlines())


@pytest.mark.parametrize(
    "argv,names",
    [
        (["machine", "--network", "no-such-net"], "no-such-net"),
        (["machine", "--batch", "8", "16"], "--batch"),
        (["machine", "--json", "/no/such/dir/m.json"], "--json"),
        (["machine", "--eviction", "cold"], "--eviction: 'cold' is not one of write, flush"),
        (["kernels", "--eviction", "flush"], "--eviction is for bench machine"),
        (["scaling", "--hosts", "2"], "--link"),
        (["scaling", "--hosts", "2", "--link", "fast"], "fast"),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--plot", "x.gif"], "--plot"),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--batch", "8"], "--network"),
        (["kernels", "--link", "1gbit"], "--link"),
        (["scaling", "--network", "seed-lcn"], "--network"),
        (["scaling", "--strategies", "data"], "--strategies"),
        (
            ["scaling", "--hosts", "2", "--link", "1gbit", "--strategies", "data,diagonal"],
            "--strategies: unknown strategy 'diagonal'",
        ),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--strategies", " , "], "--strategies"),
        (
            ["scaling", "--hosts", "2", "--link", "1gbit", "--strategies", "data,missing.json"],
            "missing.json: No such file",
        ),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--strategies", "auto,auto"], "'auto'"),
    ],
)
def test_bad_benchmark_arguments_are_one_line(argv, names, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err


def _row(link: str, bits: float, strategy: str, measured: float, predicted: float, ranks=2):
    return {
        "link": link, "link_bits": bits, "network": "seed-lcn-small", "batch": 64,
        "hosts": 2, "ranks": ranks, "strategy": strategy, "measured_s": measured,
        "predicted_s": predicted, "bulk_synchronous_s": predicted,
        "error": predicted / measured - 1, "bytes_per_step": 1000, "bytes_planned": 1000,
        "auto_chose": "spatial" if strategy == "auto" else "",
    }  # fmt: skip


def test_the_cluster_table_and_figure_put_auto_against_the_best_and_one_host_apart():
    from bench.cluster_report import ONE_HOST, format_table
    from visualize.link_sweep import link_sweep_figure

    rows = []
    for link, bits, data in (("250mbit", 2.5e8, 0.030), ("1gbit", 1e9, 0.008)):
        rows += [
            _row(link, bits, "data", data, data * 1.1),
            _row(link, bits, "spatial", 0.010, 0.011),
            _row(link, bits, "auto", 0.0105, 0.011),
            _row(link, bits, ONE_HOST, 0.009, 0.0095, ranks=1),
        ]
    rows.append({**_row("1gbit", 1e9, "model", 1, 1), "failed": "rank 1 died"})
    del rows[-1]["measured_s"]
    report = {"hosts": 2, "ranks": 2, "links": ["250mbit", "1gbit"], "results": rows}
    table = format_table(report)
    # the one-host row (faster than spatial here) is not a strategy auto is held to
    lines = {line.split(":")[0]: line for line in table.splitlines()}
    assert "auto +5.0% against the best measured (spatial)" in lines["seed-lcn-small at 250mbit"]
    assert "auto +31.2% against the best measured (data)" in lines["seed-lcn-small at 1gbit"]
    # measured data < spatial at 1 Gbit/s, and so predicted
    assert (
        "order predicted (1/1 pairs; measured data < spatial)" in lines["seed-lcn-small at 1gbit"]
    )
    assert "failed: rank 1 died" in table and "+10.0%" in table

    figure = link_sweep_figure(report)
    (ax,) = figure.axes
    labels = [line.get_label() for line in ax.lines]
    assert labels[:6] == [
        "data predicted", "data measured", "spatial predicted", "spatial measured",
        "auto predicted", "auto measured",
    ]  # fmt: skip
    data_measured = ax.lines[1]
    assert list(data_measured.get_xdata()) == [0.25, 1.0]
    assert list(data_measured.get_ydata()) == [0.030, 0.008]
    # data parallelism pays against one host only at 1 Gbit/s: its points straddle the line
    one_host = next(line for line in ax.lines if line.get_label().endswith("measured") and
                    line.get_label().startswith("one rank"))  # fmt: skip
    assert list(one_host.get_ydata()) == [0.009, 0.009]


# --- `bench scaling --hosts --strategies`: strategy files beside the built-ins ----------------

MLP = str(ROOT / "examples" / "megatron-mlp.json")
COLUMN_ROW = ROOT / "examples" / "megatron-col-row-2.json"
SPATIAL_ROW = ROOT / "examples" / "lcn-spatial-row-2.json"
#: a hand-written machine file: the four keys
MACHINE = {"rank_gflops": 50.0, "link_gbytes_per_s": 0.125, "latency_us": 60.0,
           "rank_memory_gib": 12.0}  # fmt: skip


def test_strategies_take_names_and_files_labelled_by_their_stems(tmp_path, monkeypatch):
    from bench.cluster_scaling import (
        _train_arguments,
        parse_strategies,
        predict,
        stage_schedule,
        strategy_label,
    )

    monkeypatch.chdir(ROOT)
    strategies = parse_strategies(" data, examples/megatron-col-row-2.json ,auto,data+sharded")
    # a file travels as an absolute path: the jobs run `train` from the cluster's hosts
    assert strategies == ["data", str(COLUMN_ROW), "auto", "data+sharded"]
    labels = ["data", "megatron-col-row-2", "auto", "data+sharded"]
    assert [strategy_label(s) for s in strategies] == labels
    assert parse_strategies("examples/megatron-col-row-2.json+sharded") == [f"{COLUMN_ROW}+sharded"]
    piped = parse_strategies(
        "data+2stages,model+sharded+2stages,data+autostages,model+2stages-deferred"
    )
    assert piped == [
        "data+2stages", "model+sharded+2stages", "data+autostages", "model+2stages-deferred"
    ]  # fmt: skip
    assert [_train_arguments(s) for s in piped] == [
        ["--stages", "2"], ["--param-homes", "sharded", "--stages", "2"], ["--stages", "auto"],
        ["--stages", "2", "--schedule", "1f1b-deferred"],
    ]  # fmt: skip
    assert strategy_label(piped[-1]) == "model+2stages-deferred"
    assert [stage_schedule(s) for s in piped] == ["1f1b", "1f1b", None, "1f1b-deferred"]
    predicted = predict("deep-mlp", 16, 2, "data+2stages", Machine())
    whole = predict("deep-mlp", 16, 2, "data", Machine())
    assert predicted["bytes_planned"] < whole["bytes_planned"]  # activations, not gradients
    slow = Machine(link_gbytes_per_s=0.01)
    chosen = predict("deep-mlp", 16, 2, "data+autostages", slow)
    assert chosen["auto_chose"].startswith("2 stages")  # summing the weights is slower
    assert chosen["predicted_s"] < predict("deep-mlp", 16, 2, "data", slow)["predicted_s"]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rows.json").write_text(COLUMN_ROW.read_text())
    with pytest.raises(LegionNNError, match="share the label 'rows'"):
        parse_strategies(f"{tmp_path / 'a' / 'rows.json'},{tmp_path / 'b' / 'rows.json'}")
    (tmp_path / "data.json").write_text(COLUMN_ROW.read_text())
    with pytest.raises(LegionNNError, match="share the label 'data'"):
        parse_strategies(f"data,{tmp_path / 'data.json'}")
    (tmp_path / "bad.json").write_text('{"L0": [2, 1, 1, 1]}')
    with pytest.raises(LegionNNError, match='bad.json: a strategy file is {"grids"'):
        parse_strategies(str(tmp_path / "bad.json"))


def test_a_strategy_file_that_does_not_fit_the_network_fails_before_any_cluster(capsys):
    """The MLP's units are not seed-lcn-small's: one line naming the file, no cluster brought up
    (the check comes before `cluster.require`)."""
    argv = ["bench", "scaling", "--hosts", "2", "--link", "1gbit", "--network", "seed-lcn-small",
            "--strategies", f"data,{COLUMN_ROW}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "megatron-col-row-2.json: " in err


@pytest.mark.parametrize(
    "network,batch,path",
    [(MLP, 8, COLUMN_ROW), ("seed-lcn-small", 16, SPATIAL_ROW)],
    ids=["mlp-column-row", "lcn-spatial-row"],
)
def test_a_strategy_file_is_predicted_as_partition_predicts_it(network, batch, path, tmp_path):
    """`bench scaling --hosts` prices a strategy file as `partition --strategy FILE --machine F`
    does: the same step, the same bytes."""
    from bench.cluster_scaling import predict
    from partitioner.machine_file import load_machine

    machine_file = tmp_path / "machine.json"
    machine_file.write_text(json.dumps(MACHINE))
    report = tmp_path / "partition.json"
    from bench.jobs import OPTIMIZER  # the step the benchmark's jobs train

    argv = ["partition", network, "--batch", str(batch), "--ranks", "2", "--strategy", str(path),
            "--optimizer", OPTIMIZER, "--machine", str(machine_file), "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    expected = json.loads(report.read_text())
    predicted = predict(network, batch, 2, str(path), load_machine(str(machine_file)))
    assert predicted["predicted_s"] == pytest.approx(expected["predicted_step_seconds"], rel=1e-12)
    assert predicted["bytes_planned"] == expected["bytes_sent_total"]
    assert predicted["auto_chose"] == ""
    # a reduction split, not the built-ins' plans: fewer bytes than model's
    model = predict(network, batch, 2, "model", load_machine(str(machine_file)))
    assert predicted["bytes_planned"] < model["bytes_planned"]


def test_the_cluster_benchmark_runs_a_file_under_its_path_and_labels_it_by_its_stem(
    monkeypatch, tmp_path
):
    """`run_cluster_scaling` with the cluster, `bench machine` and the jobs faked: `train` gets
    the file's path, the rows its stem, and the prediction is `predict`'s for the file."""
    from bench import cluster_matrix, cluster_scaling
    from bench.cluster_report import ONE_HOST, format_table
    from bench.cluster_scaling import predict
    from bench.jobs import Job
    from partitioner.machine import Machine
    from partitioner.machine_file import load_machine

    def fake_up(name, hosts, bits, options):
        return type("Made", (), {"name": name})()

    def fake_machine(name, ranks, network, batch, path):
        path.write_text(json.dumps(MACHINE))
        return load_machine(str(path))

    ran = []

    def fake_jobs(specs, repeat, work, say):
        ran.extend(specs)
        # the file's job kept two runs, 20% apart; the others one
        return [Job(s["network"], s["batch"], s["ranks"], s["strategy"], 0.5, 1000, {}, 0.4,
                    (0.5, 0.6) if s["strategy"] == str(COLUMN_ROW) else (0.5,))
                for s in specs]  # fmt: skip

    monkeypatch.setattr(cluster_scaling.cluster, "up", fake_up)
    monkeypatch.setattr(cluster_scaling.cluster, "down", lambda name: [])
    monkeypatch.setattr(cluster_scaling, "measure_machine", fake_machine)
    monkeypatch.setattr(cluster_scaling, "best_jobs", fake_jobs)
    strategies = ["data", str(COLUMN_ROW)]
    variants, cases = cluster_matrix.link_sweep(["1gbit"], [(MLP, 8)])
    report = cluster_scaling.run_cluster_scaling(2, variants, cases, strategies, 2)
    assert [s["strategy"] for s in ran] == ["data", str(COLUMN_ROW), "data"]
    assert [s["ranks"] for s in ran] == [2, 2, 1]
    rows = report["results"]
    assert [r["strategy"] for r in rows] == ["data", "megatron-col-row-2", ONE_HOST]
    assert rows[1]["strategy_file"] == str(COLUMN_ROW) and "strategy_file" not in rows[0]
    expected = predict(MLP, 8, 2, str(COLUMN_ROW), Machine(**MACHINE))
    assert rows[1]["predicted_s"] == pytest.approx(expected["predicted_s"], rel=1e-12)
    assert rows[1]["bytes_planned"] == expected["bytes_planned"]
    predicted_share = expected["compute_fraction_predicted"]
    assert rows[1]["compute_fraction_predicted"] == pytest.approx(predicted_share, rel=1e-12)
    table = format_table(report).splitlines()
    assert table[3].split()[:5] == ["1gbit", "1gbit", MLP, "8", "megatron-col-row-2"]
    # the share of the step a rank computes, measured (the log's) against predicted
    assert f"40%/{predicted_share:.0%}" in table[3].split()
    # and its kernels' seconds a step, measured over predicted
    kernels = 0.4 * 0.5 / (predicted_share * expected["predicted_s"])
    assert f"x{kernels:.2f}" in table[3].split()
    spread = next(line for line in table if line.startswith("kernels measured over predicted"))
    assert "one host x" in spread and "the rest x" in spread
    # the columns line up under the longer label and network
    assert table[1].index("measured") + len("measured") == table[3].index("0.5000s") + 7
    # how far each job's runs lie apart: the machine's noise, beside the error
    assert rows[1]["measured_runs_s"] == [0.5, 0.6] and rows[0]["measured_runs_s"] == [0.5]
    assert table[3].split()[8] == "+20%" and table[2].split()[8] == "-"
    assert report["summary"]["largest_run_spread"] == pytest.approx(0.2)
    assert "runs of one job apart by up to 20.0% (median 20.0%)" in table[-1]


def test_a_matrix_runs_every_case_on_every_variant_and_sums_up_the_errors(monkeypatch, tmp_path):
    """Each variant builds its cluster with its options, once per link its cases need; the
    ranks follow its ranks per host; the summary gives the mean absolute error and, per case,
    whether the measured order of the strategies was predicted."""
    from bench import cluster_matrix, cluster_report, cluster_scaling
    from bench.jobs import Job
    from partitioner.machine_file import load_machine
    from runtime.cluster_links import LinkOptions

    built = []

    def fake_up(name, hosts, bits, options):
        built.append((bits, options))
        return type("Made", (), {"name": name})()

    def fake_machine(name, ranks, network, batch, path):
        path.write_text(json.dumps(MACHINE))
        return load_machine(str(path))

    ran = []
    measured = {"data": 0.5, "model": 0.4, "auto": 0.41}

    def fake_jobs(specs, repeat, work, say):
        ran.extend(specs)
        return [Job(s["network"], s["batch"], s["ranks"], s["strategy"],
                    measured[s["strategy"]] if s["ranks"] > 1 else 0.3, 1000, {})
                for s in specs]  # fmt: skip

    monkeypatch.setattr(cluster_scaling.cluster, "up", fake_up)
    monkeypatch.setattr(cluster_scaling.cluster, "down", lambda name: [])
    monkeypatch.setattr(cluster_scaling, "measure_machine", fake_machine)
    monkeypatch.setattr(cluster_scaling, "best_jobs", fake_jobs)
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({
        "variants": [{"name": "nic", "shaping": "egress", "burst": "256k", "offload": "on"},
                     {"name": "two", "ranks_per_host": 2, "link": "unlimited"}],
        "cases": [{"network": MLP, "batch": 8, "link": "1gbit"},
                  {"network": MLP, "batch": 16, "link": "500mbit"}],
        "strategies": ["data", "model", "auto"],
    }))  # fmt: skip
    variants, cases, strategies = cluster_matrix.read_matrix(str(matrix))
    report = cluster_scaling.run_cluster_scaling(2, variants, cases, strategies)
    nic = LinkOptions("egress", 256 * 1024, True)
    # nic at each case's link, then `two` once, its link replacing both cases'
    assert built == [(1e9, nic), (5e8, nic), (None, LinkOptions())]
    assert {s["ranks"] for s in ran if s["strategy"] != "data" or s["ranks"] > 1} == {2, 4}
    rows = [r for r in report["results"] if r["strategy"] != cluster_report.ONE_HOST]
    assert len(rows) == 2 * 2 * 3 and {r["variant"] for r in rows} == {"nic", "two"}
    # one rank on one host beside each variant's file for each case: its calibration's check
    alone = [r for r in report["results"] if r["strategy"] == cluster_report.ONE_HOST]
    assert sum(s["ranks"] == 1 for s in ran) == 4
    assert sorted((r["variant"], r["batch"]) for r in alone) == [
        ("nic", 8),
        ("nic", 16),
        ("two", 8),
        ("two", 16),
    ]
    summary = report["summary"]
    errors = [abs(r["error"]) for r in report["results"]]
    assert summary["predictions"] == len(errors)
    assert summary["mean_abs_error"] == pytest.approx(sum(errors) / len(errors))
    assert summary["max_abs_error"] == pytest.approx(max(errors))
    for case in summary["cases"]:
        assert case["measured_order"] == ["model", "data"]
        predicted = {
            r["strategy"]: r["predicted_s"]
            for r in rows
            if (r["variant"], r["batch"]) == (case["variant"], case["batch"])
        }
        assert case["order_predicted"] == (predicted["model"] < predicted["data"])
        assert case["auto_against_best"] == pytest.approx(0.41 / 0.4 - 1)
    table = cluster_report.format_table(report)
    assert "mean absolute error" in table and "order " in table


@pytest.mark.parametrize(
    "matrix,names",
    [
        (
            {
                "variants": [{"name": "a", "colour": "red"}],
                "cases": [{"network": MLP, "batch": 8, "link": "1gbit"}],
            },
            "variants[0]: unknown key 'colour'",
        ),
        (
            {
                "variants": [{"name": "a", "burst": "8k"}],
                "cases": [{"network": MLP, "batch": 8, "link": "1gbit"}],
            },
            "variants[0]: --burst 8k: below the 16KiB segments",
        ),
        (
            {
                "variants": [{"name": "a", "ranks_per_host": 0}],
                "cases": [{"network": MLP, "batch": 8, "link": "1gbit"}],
            },
            "variants[0]: ranks_per_host",
        ),
        (
            {
                "variants": [{"name": "a"}],
                "cases": [{"network": "nope", "batch": 8, "link": "1gbit"}],
            },
            "cases[0]: unknown network 'nope'",
        ),
        (
            {"variants": [{"name": "a"}], "cases": [{"network": MLP, "batch": 8}]},
            "has no link in variant a",
        ),
        (
            {
                "variants": [{"name": "a"}, {"name": "a"}],
                "cases": [{"network": MLP, "batch": 8, "link": "1gbit"}],
            },
            "two variants are named alike",
        ),
        ({"cases": []}, 'a matrix is {"variants"'),
    ],
)
def test_a_bad_matrix_is_one_line_naming_the_file_and_entry(matrix, names, tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(matrix))
    assert main(["bench", "scaling", "--hosts", "2", "--matrix", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and f"--matrix {path}" in err


def test_micro_batch_pieces_are_read_from_a_traced_step_in_micro_batches():
    """Each forward and backward piece of a one-rank step in 4 micro-batches gets its in-step
    time (the trace's median less the overhead, over the factor), the copies of a layer's task
    one key; nothing else of the step is read from it."""
    from bench.traced_steps import micro_batch_pieces_in_step
    from partitioner.piece_times import piece_key

    fitted = {"task_overhead_us": 0.0, "compute_factor": 2.0}
    found = micro_batch_pieces_in_step("seed-lcn-small", 8, 4, 1, fitted, steps=4)
    graph = micro_batched(load_network("seed-lcn-small").lower(batch=8), 4)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    expected = {
        (1, piece_key(task, p.rect.shape, p.requirements))
        for task, task_plan in zip(graph.tasks, plan.tasks)
        if task.phase in ("forward", "backward") and task.op != "data"  # loading is not traced
        for p in task_plan.pieces
    }
    assert expected <= set(found)
    assert all(seconds > 0 for seconds in found.values())
    first = [t for t in graph.tasks if t.phase == "forward" and t.attrs.get("micro_batch") == 0]
    forward = [k for k in found if json.loads(k[1])[1] == "forward"]
    assert len(forward) <= len(first)  # a task's copies over the micro-batches share a key


def test_the_pieces_table_keeps_each_piece_s_median_over_the_passes(monkeypatch):
    """`measure_compute` times every piece once in each of its passes over the plans and keeps
    the median (not the first pass's, nor the mean): a slow stretch of the machine during one
    pass moves no piece; the calibration's one-rank seconds are the medians' too."""
    from bench import machine as bench_machine
    from bench import task_profile
    from bench.task_profile import profile_as_run, sample_step

    passes = iter([1.0, 5.0, 2.0])  # each pass's time for every piece
    now = {}
    real_pass = bench_machine._profile_pass

    def one_pass(*args):
        now["seconds"] = next(passes)
        return real_pass(*args)

    fitted = {"compute_factor": 1.0, "task_overhead_us": 0.0}
    calibrated = {}

    def calibrate(network, batch, threads, profiled):
        calibrated.update(profiled)
        return fitted

    monkeypatch.setattr(bench_machine, "PROFILE_PASSES", 3)
    monkeypatch.setattr(bench_machine, "_profile_pass", one_pass)
    monkeypatch.setattr(task_profile, "_time_piece", lambda *args: now["seconds"])
    monkeypatch.setattr(bench_machine, "calibrate_in_process", calibrate)
    monkeypatch.setattr(bench_machine, "micro_batch_pieces_in_step", lambda *args: {})
    rows, got = bench_machine.measure_compute("seed-lcn-small", BATCH, 2, ("data",), 1)
    assert got is fitted and rows
    assert {row["seconds"] for row in rows} == {2.0}
    graph = load_network("seed-lcn-small").lower(batch=BATCH)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    cache = {}
    monkeypatch.setattr(task_profile, "_time_piece", lambda *args: 2.0)
    assert calibrated == profile_as_run(graph, plan, 1, sample_step(graph), cache)
    assert any(seconds > 0 for seconds in calibrated.values())


@pytest.mark.parametrize(
    "profiled,steps",
    [({"a": 0.002, "b": 0.003}, 200), ({"a": 0.5}, 12), ({"a": 1e-7}, 1000), ({}, 12)],
)
def test_the_calibration_traces_a_second_of_steps_at_least(profiled, steps, monkeypatch):
    """The traced one-rank training the calibration fits spans `MIN_TIMED_S` of the profiled
    step (a short step's 12 steps fit inside one slow stretch of the machine), at least
    `CALIBRATION_STEPS` and at most `MAX_CALIBRATION_STEPS`."""
    from types import SimpleNamespace

    from bench import machine as bench_machine

    traced = []
    monkeypatch.setattr(
        bench_machine, "traced_training", lambda network, batch, steps: traced.append(steps)
    )
    fitted = SimpleNamespace(compute_gflops=1.0, op_gflops={}, memory_gbytes_per_s=1.0,
                             task_overhead_us=0.0, compute_factor=1.0, loop_seconds=0.0)  # fmt: skip
    monkeypatch.setattr(bench_machine, "calibrate", lambda *args: fitted)
    monkeypatch.setattr(bench_machine, "memory_bandwidth", lambda: 1.0)
    bench_machine.calibrate_in_process("seed-lcn-small", 8, 1, profiled)
    assert traced == [steps]
