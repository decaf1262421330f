"""`bench scaling`'s calibration recovers the terms a trace was made from."""

from __future__ import annotations

import pytest

from legion_nn.networks import load_network
from partitioner.accounting import bytes_per_rank, task_flops
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.bench_scaling import OPTIMIZER, WARMUP, Job, calibrate

OVERHEAD_S = 40e-6
BANDWIDTH = 12e9  # bytes/s the runtime's own passes reach: well below the streaming add's
STREAMING = 38.0  # GB/s, what `memory_bandwidth` measured
RATE = 50e9  # FLOP/s of every op


def synthetic_job(network: str, batch: int) -> Job:
    """A 1-rank trace whose every task took exactly what the model's terms say."""
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    flops = {name: sum(per.values()) for name, per in task_flops(graph, plan).items()}
    events = []
    for step in range(WARMUP, WARMUP + 3):
        for task, traffic in zip(graph.tasks, bytes_per_rank(graph, plan)):
            work = flops.get(task.name, 0.0)
            seconds = OVERHEAD_S + (work / RATE if work else float(traffic[0]) / BANDWIDTH)
            events.append(
                {"ph": "X", "pid": 0, "tid": 0, "cat": "compute", "name": task.name,
                 "ts": 0, "dur": seconds * 1e6, "args": {"step": step, "task": task.name}}
            )  # fmt: skip
    return Job(network, batch, 1, "data", 0.0, 0, {"traceEvents": events})


def test_weight_sized_zeroing_calibrates_the_memory_bandwidth():
    calibration = calibrate(synthetic_job("seed-lcn", 4), 1, STREAMING)
    assert calibration.memory_gbytes_per_s == pytest.approx(BANDWIDTH / 1e9, rel=0.02)
    assert calibration.task_overhead_us == pytest.approx(OVERHEAD_S * 1e6, rel=0.2)
    for rate in calibration.op_gflops.values():
        assert rate == pytest.approx(RATE / 1e9, rel=0.02)


def test_without_large_zeroing_the_streaming_bandwidth_stands():
    """seed-lcn-small zeroes nothing weight-sized: its small tasks say nothing of bandwidth."""
    calibration = calibrate(synthetic_job("seed-lcn-small", 8), 1, STREAMING)
    assert calibration.memory_gbytes_per_s == STREAMING
    assert calibration.task_overhead_us == pytest.approx(OVERHEAD_S * 1e6, rel=0.2)
