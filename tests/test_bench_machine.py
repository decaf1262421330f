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
from pathlib import Path

import pytest

from legion_nn.cli import main
from legion_nn.networks import load_network
from partitioner.machine import load_machine
from partitioner.piece_times import task_piece_times
from partitioner.plan import build_plan
from partitioner.strategy import builtin

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_bench_machine_under_mpiexec_writes_a_file_partition_prices_from(tmp_path, capsys):
    path = tmp_path / "machine.json"
    command = [
        "mpiexec", "-n", "2", sys.executable, "-m", "legion_nn.cli", "bench", "machine",
        "--network", "seed-lcn-small", "--batch", str(BATCH), "--quick", "--quiet",
        "--json", str(path),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=_environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    assert "2 rank(s) per host" in result.stdout  # rank 0's summary, printed once
    assert result.stdout.count("rank(s) per host") == 1
    data = json.loads(path.read_text())
    assert data["hosts"] == 1 and data["ranks_per_host"] == 2
    assert data["measured_on"]["links_measured"] == ["intra_host"]
    assert {p["pair"] for p in data["pingpong"]} == {"intra_host"}
    assert data["rank_memory_gib"] > 0 and data["rank_cores"] >= 1
    assert data["compute_factor"] > 0 and data["task_overhead_us"] >= 0 and data["loop_us"] > 0

    machine = load_machine(str(path))
    assert machine.to_json() == data
    # every piece of the network's fixed plans on 1 and 2 ranks was timed
    graph = load_network("seed-lcn-small").lower(batch=BATCH, optimizer="sgd")
    for strategy, ranks in (("data", 1), ("data", 2), ("model", 2), ("spatial", 2)):
        plan = build_plan(graph, builtin(graph, strategy, ranks), ranks)
        times = task_piece_times(graph, plan, machine.pieces)
        missing = [t.name for t, s in zip(graph.tasks, times) if s is None]
        assert not missing, (strategy, ranks, missing)

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
        (["scaling", "--hosts", "2"], "--link"),
        (["scaling", "--hosts", "2", "--link", "fast"], "fast"),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--plot", "x.gif"], "--plot"),
        (["scaling", "--hosts", "2", "--link", "1gbit", "--batch", "8"], "--network"),
        (["kernels", "--link", "1gbit"], "--link"),
        (["scaling", "--network", "seed-lcn"], "--network"),
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
    from bench.cluster_scaling import ONE_HOST, format_table
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
    assert "seed-lcn-small at 250mbit: auto +5.0% against the best measured (spatial)" in table
    assert "seed-lcn-small at 1gbit: auto +31.2% against the best measured (data)" in table
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
