"""`legion-nn bench step`: the roofline's bounds, the measured step, the PyTorch peer's math."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.step import STEPS, measure, paired_ratio, roofline
from cli.main import main
from legion_nn.networks import load_network
from legion_nn.op_records import flops_per_element


def test_every_task_is_bounded_by_its_flops_or_its_bytes():
    graph = load_network("seed-lcn-small").lower(batch=4, optimizer="adam")
    rows = roofline(graph, gflops=100.0, gbytes_per_s=10.0)
    assert [r["task"] for r in rows] == [t.name for t in graph.tasks]
    for task, row in zip(graph.tasks, rows):
        flops = flops_per_element(task, graph.tensors) * task.space.volume
        assert row["flops"] == pytest.approx(flops)
        assert row["bound_s"] == pytest.approx(max(flops / 100e9, row["bytes"] / 10e9))
        compute_bound = flops / 100e9 >= row["bytes"] / 10e9
        assert row["bound_by"] == ("compute" if compute_bound else "memory")
    # a weight's update reads its gradient and moments and rewrites the weight and moments
    update = next(r for r in rows if r["task"] == "update_L1.W")
    weight = graph.tensors["L1.W"].nbytes
    assert update["bytes"] == 7 * weight and update["bound_by"] == "memory"
    # at batch 64 each of L1's untied weights serves 64 samples: compute-bound
    big = roofline(load_network("seed-lcn-small").lower(batch=64), 100.0, 10.0)
    assert next(r for r in big if r["task"] == "L1.filter")["bound_by"] == "compute"


def test_the_measured_step_times_every_task_that_runs():
    network = load_network("seed-lcn-small")
    graph = network.lower(batch=4, optimizer="adam")
    beside = []
    step, tasks, per_task, elided, fused, steps = measure(
        graph, network, 4, lambda: beside.append(len(beside))
    )
    assert len(steps) == STEPS and step == pytest.approx(np.median(steps))
    assert len(beside) == STEPS + 1  # before the first timed step and after each
    assert set(per_task) == {t.name for t in graph.tasks} - elided - set(fused)
    assert "L1.W.grad.set_zero" in elided
    # one process: each weight's update runs inside the kernel of its gradient; a bias's,
    # whose gradient the adapter returns, does not
    assert fused == {
        "update_L0.W": "L0.filter.grad",
        "update_L1.W": "L1.filter.grad",
        "update_W1": "classifier.linear1.grad",
    }
    # each step's tasks run within it, one after another: so do the medians
    assert 0 < tasks <= step


def test_each_step_is_set_against_its_roofline_at_the_sgemm_beside_it():
    def bound(rate):  # a step of 100 GFLOP at the SGEMM's rate
        return 100.0 / rate

    # steps of 1 s; SGEMMs of 100, 200, 50, 100 GFLOP/s: rooflines at 200, 200, 100 GFLOP/s
    ratios = [1.0 / 0.5, 1.0 / 0.5, 1.0 / 1.0]
    assert paired_ratio([1.0, 1.0, 1.0], [100.0, 200.0, 50.0, 100.0], bound) == pytest.approx(
        np.median(ratios)
    )
    assert paired_ratio([2.0], [100.0, 100.0], bound) == pytest.approx(2.0)


def test_bench_step_writes_its_report(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert (
        main(["bench", "step", "seed-lcn-small", "--batch", "4", "--quiet", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["roofline_s"] == pytest.approx(sum(r["bound_s"] for r in report["tasks"]))
    assert report["measured_s"] > 0 and report["sgemm_gflops"] > 0
    assert len(report["sgemm_beside_gflops"]) == STEPS + 1
    assert report["paired_roofline_ratio"] > 0
    assert "roofline" in capsys.readouterr().out
    assert main(["bench", "kernels", "seed-lcn"]) == 2
    assert "is for bench step" in capsys.readouterr().err


def test_the_peers_untied_filter_is_a_locally_connected_layer():
    torch = pytest.importorskip("torch")
    from bench.torch_peer import peer_model
    from legion_nn.spec import network_from_dict

    network = network_from_dict(
        {
            "name": "lc", "input": [2, 6, 5], "classes": 3,
            "layers": [
                {"kind": "filter", "name": "L0", "out_channels": 3, "kernel": [3, 2],
                 "untied": True, "stride": 1, "pad": [1, 0, 0, 1]},
                {"kind": "linear", "name": "fc", "out": 3},
                {"kind": "softmax"},
            ],
        },
        "lc",
    )  # fmt: skip
    model, _ = peer_model(network)
    model = model.double()
    x = torch.randn(4, 2, 6, 5, dtype=torch.float64)
    untied = model[0]
    got = untied(x).detach().numpy()
    k, r, s, p, q, _, _ = untied.shape
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (1, 0), (0, 1)))
    weights = untied.w.detach().numpy().reshape(p, q, k, 2, r, s)
    want = np.zeros((4, k, p, q))
    for i in range(p):
        for j in range(q):
            window = padded[:, :, i : i + r, j : j + s]
            want[:, :, i, j] = np.einsum("ncrs,kcrs->nk", window, weights[i, j])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_fused_update_is_bounded_with_the_task_that_runs_it():
    from bench.step import _fuse_row

    graph = load_network("seed-lcn-small").lower(batch=4, optimizer="adam")
    rows = {r["task"]: r for r in roofline(graph, gflops=100.0, gbytes_per_s=10.0)}
    into, update = dict(rows["L1.filter.grad"]), dict(rows["update_L1.W"])
    weight = graph.tensors["L1.W"].nbytes
    _fuse_row(graph, update, into, 100.0, 10.0)
    # the task no longer reduces into the gradient (read and written), the update no longer
    # reads it: its weights and moments, read and written, are what the update adds
    assert into["bytes"] == rows["L1.filter.grad"]["bytes"] - 2 * weight + 6 * weight
    assert into["flops"] == rows["L1.filter.grad"]["flops"] + rows["update_L1.W"]["flops"]
    expected_own = max(
        rows["L1.filter.grad"]["flops"] / 100e9,
        (rows["L1.filter.grad"]["bytes"] - 2 * weight) / 10e9,
    )
    assert into["bound_s"] == pytest.approx(expected_own + 6 * weight / 10e9)
    assert into["fused"] == "update_L1.W"
    assert (update["bound_s"], update["bound_by"], update["fused_into"]) == (
        0.0,
        "fused",
        "L1.filter.grad",
    )
