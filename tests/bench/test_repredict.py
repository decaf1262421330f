"""`bench/repredict.py`: a saved `bench scaling` run predicted again from its own machine files."""

from __future__ import annotations

import json

import pytest

from bench.cluster_report import ONE_HOST
from bench.cluster_scaling import predict
from bench.repredict import main, repredicted
from partitioner.machine_file import machine_from_json

#: a hand-written machine file of the four basic keys, as a run saves it with its case's keys
MACHINE = {"rank_gflops": 20.0, "link_gbytes_per_s": 0.125, "latency_us": 50.0,
           "rank_memory_gib": 8.0}  # fmt: skip
CASE = {"variant": "tbf-both", "link": "1gbit", "network": "seed-lcn-small", "batch": 8}


def saved_run() -> dict:
    rows = [
        CASE
        | {"ranks": 2, "strategy": "data", "predicted_s": 0.5, "measured_s": 0.02}
        | {"compute_fraction_measured": 0.25},
        CASE | {"ranks": 1, "strategy": ONE_HOST, "predicted_s": 0.5, "measured_s": 0.01},
        CASE | {"ranks": 2, "strategy": "model", "failed": "no memory"},
    ]
    return {"machines": [CASE | MACHINE], "results": rows}


def test_each_measured_case_is_predicted_from_its_own_file_as_bench_scaling_predicts_it():
    rows = repredicted(saved_run(), "run.json")
    assert [r["strategy"] for r in rows] == ["data", ONE_HOST]  # the failed job is left out
    machine = machine_from_json(dict(MACHINE))
    for row, ranks in zip(rows, (2, 1)):
        now = predict("seed-lcn-small", 8, ranks, "data", machine)["predicted_s"]
        assert row["predicted_now_s"] == pytest.approx(now, rel=1e-12)
        assert row["error_now"] == pytest.approx(now / row["measured_s"] - 1.0)
    # what the run predicted then is kept beside
    assert rows[0]["predicted_s"] == 0.5
    # the run's kernel seconds a step over those predicted now, where the run measured them
    now = predict("seed-lcn-small", 8, 2, "data", machine)
    expected = 0.25 * 0.02 / (now["compute_fraction_predicted"] * now["predicted_s"])
    assert rows[0]["kernels_now"] == pytest.approx(expected, rel=1e-12)
    assert rows[1]["kernels_now"] is None


def test_the_table_ends_with_both_errors(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved_run()))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("then: mean absolute error") and out[-2].endswith("of 2 within 15%")
    assert out[-1].startswith("now:  mean absolute error")
