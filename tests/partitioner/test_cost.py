"""Cost model, machine files, auto search and the `partition` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from legion_nn.rect import Rect
from partitioner.accounting import bytes_per_rank, fits, memory_by_unit, memory_per_rank
from partitioner.collective_prices import reduction_cost
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.machine_file import calibrate, load_machine, machine_from_json
from partitioner.plan import build_plan
from partitioner.search.auto import auto
from partitioner.strategy import builtin
from partitioner.task_plan import Reduction
from runtime.step.rank_memory import predict

MACHINE = Machine(100, 12.5, 2, 16)


def test_all_reduce_of_a_replicated_parameter():
    """Over 4 ranks by halving-doubling (`collective_prices.allreduce_algorithm`): the ring's bytes, each of
    4 ranks sending 2(p − 1)/p of them, in 2·log2 4 exchanges rather than the ring's 6; over
    3 ranks by the ring, which moves no vector whole."""
    n = 64 * 64 * 7 * 7 * 27 * 27  # L1.W, float32
    for ranks, messages in (((0, 1, 2, 3), 2 * 2), ((0, 1, 2), 2 * (3 - 1))):
        p = len(ranks)
        reduction = Reduction("L1.W.grad", "allreduce", ranks, ((Rect.from_dims((n,)), ranks),), 4)
        seconds, wire = reduction_cost(reduction, MACHINE)
        assert wire == 2 * (p - 1) * n * 4
        shared = 2 * (p - 1) / p * n * 4 / 12.5e9
        assert seconds == pytest.approx(messages * 2e-6 + shared)
        # where memory traffic is priced, the adds read two operands and write one
        roofline = Machine(100, 12.5, 2, 16, memory_gbytes_per_s=25)
        seconds, _ = reduction_cost(reduction, roofline)
        local = 3 * (p - 1) / p * n * 4 / 25e9
        assert seconds == pytest.approx(messages * 2e-6 + shared + local)


def test_the_roofline_prices_bytes_and_the_overhead_per_task():
    graph = load_network("seed-lcn").lower(batch=4)
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    flat = plan_cost(graph, plan, MACHINE)
    roofline = Machine(100, 12.5, 2, 16, memory_gbytes_per_s=20, task_overhead_us=7)
    priced = plan_cost(graph, plan, roofline)
    traffic = bytes_per_rank(graph, plan)
    by_name = {t.name: t for t in graph.tasks}
    for before, after, moved in zip(flat.tasks, priced.tasks, traffic):
        op = by_name[before.task].op
        memory = 0.0 if op == "data" else moved.max() / 20e9
        assert after.compute_s == pytest.approx(max(before.compute_s, memory) + 7e-6)
        assert after.comm_s >= before.comm_s
    # zeroing a replicated 585 MB gradient costs its bytes; the classifier at batch 2 a rank
    # is bound by reading its 566 MB of weights, not by its FLOPs
    zero = next(t for t in priced.tasks if t.task == "L1.W.grad.set_zero")
    assert zero.compute_s == pytest.approx(585_252_864 / 20e9 + 7e-6, rel=1e-6)
    linear = next(t for t in priced.tasks if t.task == "classifier.linear1")
    assert linear.compute_s > 2 * linear.flops_max / 100e9


def test_measured_compute_replaces_the_flop_model_and_keeps_the_rest():
    graph = load_network("seed-lcn-small").lower(batch=8)
    plan = build_plan(graph, builtin(graph, "model", 2), 2)
    machine = Machine(100, 12.5, 2, 16, memory_gbytes_per_s=20, task_overhead_us=7)
    modelled = plan_cost(graph, plan, machine)
    measured = {task.name: 1e-3 * (k + 1) for k, task in enumerate(graph.tasks)}
    priced = plan_cost(graph, plan, machine, measured)
    for before, after in zip(modelled.tasks, priced.tasks):
        assert after.compute_s == pytest.approx(measured[after.task] + 7e-6)
        assert (after.comm_s, after.bytes_sent) == (before.comm_s, before.bytes_sent)
    assert priced.memory == modelled.memory
    # a task the measurement leaves out keeps its modelled compute
    del measured["L1.filter"]
    partial = plan_cost(graph, plan, machine, measured)
    kept = next(t for t in partial.tasks if t.task == "L1.filter")
    assert kept.compute_s == next(t for t in modelled.tasks if t.task == "L1.filter").compute_s


def test_data_parallel_step_is_dominated_by_the_weight_all_reduce():
    graph = load_network("seed-lcn").lower(batch=256)
    cost = plan_cost(graph, build_plan(graph, builtin(graph, "data", 64), 64), MACHINE)
    weights = sum(t.nbytes for t in graph.tensors.values() if t.kind == "param")
    assert 1.1e9 < weights < 1.3e9
    assert cost.step_seconds > 2 * 63 / 64 * weights / 12.5e9


def test_auto_beats_data_parallelism_threefold_and_every_pure_strategy():
    graph = load_network("seed-lcn").lower(batch=256)
    result = auto(graph, 64, MACHINE)
    auto_s = plan_cost(graph, build_plan(graph, result.strategy, 64), MACHINE).step_seconds
    pure = {
        name: plan_cost(graph, build_plan(graph, builtin(graph, name, 64), 64), MACHINE)
        for name in ("data", "model", "spatial")
    }
    assert pure["data"].step_seconds >= 3 * auto_s
    assert auto_s <= min(c.step_seconds for c in pure.values()) + 1e-12
    assert all(
        c.seconds <= c.data_seconds or c.family == "data" or c.seconds < 1e-3
        for c in result.choices
    )


def test_memory_capacity_makes_a_plan_infeasible():
    graph = load_network("seed-lcn").lower(batch=256)
    small = Machine(100, 12.5, 2, 1)
    cost = plan_cost(graph, build_plan(graph, builtin(graph, "data", 4), 4), small)
    assert not cost.feasible


def test_machine_files(tmp_path):
    assert load_machine(None) == MACHINE
    with pytest.raises(LegionNNError, match="missing latency_us"):
        machine_from_json({"rank_gflops": 1, "link_gbytes_per_s": 1, "rank_memory_gib": 1})
    with pytest.raises(LegionNNError, match="rank_gflops must be a positive number"):
        machine_from_json(
            {"rank_gflops": 0, "link_gbytes_per_s": 1, "latency_us": 1, "rank_memory_gib": 1}
        )
    bad = tmp_path / "m.json"
    bad.write_text("{nope")
    with pytest.raises(LegionNNError, match="not JSON"):
        load_machine(str(bad))


def test_machine_files_optional_keys():
    base = {"rank_gflops": 10, "link_gbytes_per_s": 2, "latency_us": 3, "rank_memory_gib": 4}
    plain = machine_from_json(base)
    assert plain.memory_gbytes_per_s is None and plain.seconds_per_memory_byte == 0.0
    assert plain.task_overhead == 0.0 and plain.to_json() == base
    full = machine_from_json({**base, "memory_gbytes_per_s": 20, "task_overhead_us": 15})
    assert full.seconds_per_memory_byte == pytest.approx(1 / 20e9)
    assert full.task_overhead == pytest.approx(15e-6)
    assert machine_from_json(full.to_json()) == full
    with pytest.raises(LegionNNError, match="memory_gbytes_per_s must be a positive number"):
        machine_from_json({**base, "memory_gbytes_per_s": 0})
    with pytest.raises(LegionNNError, match="task_overhead_us must be a number >= 0"):
        machine_from_json({**base, "task_overhead_us": -1})
    with pytest.raises(LegionNNError, match="unknown key 'memory_bw'"):
        machine_from_json({**base, "memory_bw": 1})


def test_partition_command_json_and_errors(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "partition",
                "seed-lcn-small",
                "--ranks",
                "4",
                "--strategy",
                "spatial",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    for key in (
        "ranks",
        "strategy",
        "predicted_step_seconds",
        "bytes_sent_total",
        "memory_per_rank_max",
    ):
        assert key in report
    assert {"layer", "grid", "flops_per_rank", "bytes_sent", "seconds"} <= set(report["layers"][0])
    assert "total" in capsys.readouterr().out
    assert main(["partition", "seed-lcn-small", "--ranks", "0", "--strategy", "data"]) == 2
    assert main(["partition", "seed-lcn-small", "--ranks", "4", "--strategy", "nope"]) == 2
    grids = tmp_path / "g.json"
    grids.write_text(json.dumps({"grids": {"L0": [1, 1, 2, 1]}}))
    assert main(["partition", "seed-lcn-small", "--ranks", "4", "--strategy", str(grids)]) == 2
    assert "makes 2 pieces, not 4" in capsys.readouterr().err


def test_sweep_writes_a_png(tmp_path):
    png = tmp_path / "s.png"
    assert (
        main(
            [
                "partition",
                "seed-lcn-small",
                "--strategy",
                "data",
                "--sweep",
                "1,2,4",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"


def _report(tmp_path, strategy: str, *extra: str) -> dict:
    out = tmp_path / f"{strategy}.json"
    args = ["partition", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", strategy]
    assert main([*args, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_memory_per_layer_adds_up_to_the_step(tmp_path, capsys):
    data = _report(tmp_path, "data")
    assert "held max" in capsys.readouterr().out
    rows = {row["layer"]: row for row in data["layers"]}
    for report in (data, _report(tmp_path, "spatial")):
        layers = report["layers"]
        # every byte a rank holds all step is in exactly one row: the rows' means add up to the
        # step's count
        assert sum(r["memory_per_rank_mean"] for r in layers) == pytest.approx(
            report["memory_held_per_rank_mean"]
        )
        assert max(r["memory_per_rank_max"] for r in layers) <= report["memory_held_per_rank_max"]
        assert all(r["memory_per_rank_mean"] <= r["memory_per_rank_max"] for r in layers)
        # the memory per rank is the runtime's: its buffers as placed, and the baseline
        graph = load_network("seed-lcn-small").lower(batch=8, optimizer="adam")
        plan = build_plan(graph, builtin(graph, report["strategy"], 4), 4)
        peaks = [m.peak for m in predict(graph, plan).values()]
        assert report["memory_per_rank_max"] == max(peaks)
        assert report["process_baseline_bytes"] == Machine().process_baseline_bytes
    # data parallel: every rank holds all of L0's untied weights and their gradient, and a
    # quarter of the batch of its three activations
    weights = 2 * (204800 + 4 + 8192)
    activations = 3 * 65536 // 4
    assert rows["L0"]["memory_per_rank_max"] >= weights + activations
    # a 2x2 spatial split keeps each rank's weight sets with its output positions
    spatial = {row["layer"]: row for row in _report(tmp_path, "spatial")["layers"]}
    assert spatial["L0"]["memory_per_rank_max"] < rows["L0"]["memory_per_rank_max"] / 2


def _row(pass_: str, untied: bool, n: int, gflops: float, impl: str = "legion-nn") -> dict:
    shape = {"N": n, "C": 64, "K": 64, "R": 7, "S": 7, "P": 27, "Q": 27}
    return {"op": "filter", "pass": pass_, "impl": impl, "untied": untied, "shape": shape,
            "gflops": gflops}  # fmt: skip


BENCH = {
    "sgemm_gflops": 200.0,
    "results": [
        _row("forward", True, 64, 40.0),
        _row("forward", True, 256, 60.0),
        _row("backward_data", True, 256, 25.0),
        _row("backward_filter", True, 256, 100.0),
        _row("forward", False, 256, 80.0),
        _row("backward_data", False, 256, 70.0),
        _row("backward_filter", False, 256, 90.0),
        _row("forward", True, 256, 1.0, impl="numpy"),
    ],
}


def test_calibration_sets_the_throughput_of_each_pass():
    machine = calibrate(MACHINE, BENCH)
    assert machine.flops_per_second("filter", "forward", "untied") == 50e9  # mean over batches
    assert machine.flops_per_second("conv", "backward_filter", "tied") == 90e9
    assert machine.flops_per_second("linear", "backward") == 200e9  # GEMMs at the SGEMM rate
    assert machine.flops_per_second("filterNL", "forward") == 100e9  # uncalibrated: rank_gflops
    graph = load_network("seed-lcn-small").lower(batch=8)
    costs = {
        c.task: c
        for c in plan_cost(graph, build_plan(graph, builtin(graph, "data", 4), 4), machine).tasks
    }
    forward, grad, first = costs["L1.filter"], costs["L1.filter.grad"], costs["L0.filter.grad"]
    assert forward.compute_s == pytest.approx(forward.flops_max / 50e9)
    # input and weight gradients, half the FLOPs each, at their own rates
    assert grad.compute_s == pytest.approx(grad.flops_max / 2 / 25e9 + grad.flops_max / 2 / 100e9)
    # the first layer's input is data: only the weight gradient is computed
    assert first.compute_s == pytest.approx(first.flops_max / 100e9)
    assert costs["classifier.linear1"].compute_s == pytest.approx(
        costs["classifier.linear1"].flops_max / 200e9
    )


def test_partition_calibrate_flag(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    plain = _report(tmp_path, "data")
    calibrated = _report(tmp_path, "data", "--calibrate", str(bench))
    assert calibrated["machine"]["op_gflops"]["filter.backward_data.untied"] == 25.0
    assert calibrated["predicted_step_seconds"] > plain["predicted_step_seconds"]
    capsys.readouterr()
    args = ["partition", "seed-lcn-small", "--ranks", "4", "--strategy", "data", "--calibrate"]
    bench.write_text("{nope")
    assert main([*args, str(bench)]) == 2
    assert "--calibrate" in capsys.readouterr().err
    bench.write_text(json.dumps({"results": [_row("forward", True, 64, 1.0, impl="numpy")]}))
    assert main([*args, str(bench)]) == 2
    assert "no legion-nn filter measurements" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["data", "model", "spatial"])
def test_fits_agrees_with_the_exact_memory_count(name):
    graph = load_network("seed-lcn-small").lower(batch=8)
    plan = build_plan(graph, builtin(graph, name, 4), 4)
    exact = max(memory_per_rank(graph, plan).values())
    bound = max(
        sum(rows)
        for rows in zip(*(r.tolist() for r in memory_by_unit(graph, plan, False).values()))
    )
    assert bound >= exact
    for capacity in (exact - 1, exact, (exact + bound) // 2, bound):
        assert fits(graph, plan, capacity) == (exact <= capacity)


def test_collective_costs_of_many_equal_those_of_each():
    from partitioner.collective_prices import collective_cost, collective_costs

    rng = np.random.default_rng(7)
    for machine in (MACHINE, Machine(7, 0.3, 17, 1)):
        p = rng.integers(0, 3000, 5000)
        n = rng.integers(0, 10**10, 5000)
        n[::9] = 0
        largest = (n * rng.random(5000)).astype(np.int64)
        reduce = rng.random(5000) < 0.5
        seconds, wire = collective_costs(reduce, p, n, largest, machine)
        for k in range(5000):
            kind = "reduce" if reduce[k] else "reduce_scatter"
            expected = collective_cost(kind, int(p[k]), int(n[k]), int(largest[k]), machine)
            assert expected == (seconds[k], wire[k])


def test_partition_verify_runs_verify_plan(monkeypatch, capsys):
    from legion_nn.errors import VerifyError
    from partitioner import verify_plan

    argv = ["partition", "seed-lcn-small", "--ranks", "3", "--strategy", "spatial", "--verify"]
    assert main(argv) == 0  # a real plan passes
    capsys.readouterr()

    def broken(graph, plan):
        raise VerifyError("task L1.filter: pieces overlap")

    monkeypatch.setattr(verify_plan, "verify_plan", broken)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pieces overlap" in err
    assert main(argv[:-1]) == 0  # without --verify the check does not run


def test_partition_predicts_trains_optimizer_and_dtype_by_default(tmp_path):
    """`partition` lowers the step `train` runs: Adam unless told otherwise, whose two moments
    per parameter are memory; float64 doubles every tensor's bytes."""
    from cli.main import main
    from legion_nn.networks import load_network

    def memory(*extra: str) -> int:
        out = tmp_path / "plan.json"
        args = ["partition", "seed-lcn-small", "--batch", "4", "--ranks", "1", "--json", str(out)]
        assert main([*args, "--strategy", "data", *extra]) == 0
        return json.loads(out.read_text())["memory_held_per_rank_max"]

    graph = load_network("seed-lcn-small").lower(batch=4)
    params = sum(t.nbytes for t in graph.tensors.values() if t.kind == "param")
    assert memory() == memory("--optimizer", "adam")
    assert memory() - memory("--optimizer", "sgd") == 2 * params
    # on one rank each tensor is held once; the labels (int32) and evaluate's sums (float64)
    # keep their types
    kept = sum(t.nbytes for t in graph.tensors.values() if t.dtype != "float32")
    assert kept > 0
    wide = memory("--optimizer", "sgd", "--dtype", "float64")
    assert wide == 2 * memory("--optimizer", "sgd") - kept
