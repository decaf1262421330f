"""`bench scaling`'s calibration recovers the terms a trace and a profile were made from."""

from __future__ import annotations

import pytest

from bench import jobs
from bench.calibration import calibrate
from bench.jobs import MIN_TIMED_STEPS, OPTIMIZER, WARMUP, Job, best_jobs
from bench.scaling import format_table
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.accounting import bytes_per_rank, task_flops
from partitioner.plan import build_plan
from partitioner.strategy import builtin

OVERHEAD_S = 40e-6
FACTOR = 1.25  # a kernel in a step against the same kernel profiled alone
BANDWIDTH = 12e9  # bytes/s the runtime's own passes reach: well below the streaming add's
STREAMING = 38.0  # GB/s, what `memory_bandwidth` measured
RATE = 50e9  # FLOP/s of every op


def synthetic_job(network: str, batch: int) -> tuple[Job, dict[str, float]]:
    """A 1-rank trace whose every task took exactly what the model's terms say, and the profile
    of its kernels: the same less the overhead, over the factor."""
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    flops = {name: sum(per.values()) for name, per in task_flops(graph, plan).items()}
    events, profiled = [], {}
    for step in range(WARMUP, WARMUP + 3):
        for task, traffic in zip(graph.tasks, bytes_per_rank(graph, plan)):
            work = flops.get(task.name, 0.0)
            kernel = work / RATE if work else float(traffic[0]) / BANDWIDTH
            profiled[task.name] = kernel / FACTOR
            seconds = OVERHEAD_S + kernel
            events.append(
                {"ph": "X", "pid": 0, "tid": 0, "cat": "compute", "name": task.name,
                 "ts": 0, "dur": seconds * 1e6, "args": {"step": step, "task": task.name}}
            )  # fmt: skip
    return Job(network, batch, 1, "data", 0.0, 0, {"traceEvents": events}), profiled


def test_weight_sized_zeroing_calibrates_the_memory_bandwidth():
    job, profiled = synthetic_job("seed-lcn", 4)
    calibration = calibrate(job, 1, STREAMING, profiled)
    assert calibration.memory_gbytes_per_s == pytest.approx(BANDWIDTH / 1e9, rel=0.02)
    assert calibration.task_overhead_us == pytest.approx(OVERHEAD_S * 1e6, rel=1e-6)
    assert calibration.compute_factor == pytest.approx(FACTOR, rel=1e-9)
    for rate in calibration.op_gflops.values():
        assert rate == pytest.approx(RATE / 1e9, rel=0.02)


def test_the_rate_of_unpriced_ops_is_that_of_the_networks_flops():
    """Memory-bound tasks have few FLOPs and long times: their "rates" are tiny, and a rate for
    ops no key prices must not be read off them (a median of the rates was 0.09 GFLOP/s on a
    deep MLP, and priced its Adam updates at seconds)."""
    job, profiled = synthetic_job("seed-lcn-small", 8)
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer=OPTIMIZER)
    light = {t.name for t in graph.tasks if t.op not in ("filter", "linear")}
    for event in job.trace["traceEvents"]:
        if event["name"] in light:  # their kernels 100 times slower, alone and in the step
            event["dur"] = OVERHEAD_S * 1e6 + (event["dur"] - OVERHEAD_S * 1e6) * 100
    profiled = {name: t * 100 if name in light else t for name, t in profiled.items()}
    calibration = calibrate(job, 1, STREAMING, profiled)
    rates = sorted(calibration.op_gflops.values())
    assert rates[len(rates) // 2] < RATE / 1e9 / 10  # the median is a memory-bound op's
    assert calibration.compute_gflops == pytest.approx(RATE / 1e9, rel=0.1)


def test_fused_updates_give_their_op_no_rate():
    """An update fused into its gradient's product (`runtime.step.update_fusion`) is profiled at
    0 and traces only its bookkeeping: its FLOPs over those microseconds read as 0.035 GFLOP/s
    and priced a sharded plan's shard updates at seconds. Only tasks whose kernels ran give a
    rate; the others' ops fall to the network's."""
    job, profiled = synthetic_job("seed-lcn-small", 8)
    updates = {e["name"] for e in job.trace["traceEvents"] if e["name"].startswith("update_")}
    assert updates
    for event in job.trace["traceEvents"]:
        if event["name"] in updates:
            event["dur"] = OVERHEAD_S * 1e6  # bookkeeping alone
    profiled = {name: 0.0 if name in updates else t for name, t in profiled.items()}
    calibration = calibrate(job, 1, STREAMING, profiled)
    assert "update.update" not in calibration.op_gflops
    for rate in calibration.op_gflops.values():
        assert rate == pytest.approx(RATE / 1e9, rel=0.02)


def test_without_large_zeroing_the_streaming_bandwidth_stands():
    """seed-lcn-small zeroes nothing weight-sized: its small tasks say nothing of bandwidth."""
    job, profiled = synthetic_job("seed-lcn-small", 8)
    calibration = calibrate(job, 1, STREAMING, profiled)
    assert calibration.memory_gbytes_per_s == STREAMING
    assert calibration.task_overhead_us == pytest.approx(OVERHEAD_S * 1e6, rel=1e-6)
    assert calibration.compute_factor == pytest.approx(FACTOR, rel=1e-9)


def test_the_overhead_is_read_off_the_small_tasks_whatever_the_large_ones_vary():
    """Every task's time 5% off, alternately up and down (a machine's slow and fast stretches
    scale a task's time): the per-task overhead stays within the small tasks' share of that
    noise, where a fit of absolute residuals lets seed-lcn's tenth-of-a-second tasks set it."""
    job, profiled = synthetic_job("seed-lcn", 16)
    for index, event in enumerate(job.trace["traceEvents"]):
        event["dur"] *= 1.05 if index % 2 else 0.95
    calibration = calibrate(job, 1, STREAMING, profiled)
    assert calibration.task_overhead_us == pytest.approx(OVERHEAD_S * 1e6, rel=0.1)
    assert calibration.compute_factor == pytest.approx(FACTOR, rel=0.05)


def test_the_factor_is_the_steps_where_small_tasks_slow_down_more_than_large_ones():
    """Tasks under a millisecond three times their profiles in the step, the others at
    FACTOR: the factor is the one that sums the profiled step and the overheads to the traced
    step, nearer the large tasks' factor, which carry it, than the small ones'."""
    job, profiled = synthetic_job("seed-lcn", 16)
    small = {name for name, kernel in profiled.items() if kernel * FACTOR < 1e-3}
    for event in job.trace["traceEvents"]:
        if event["name"] in small:
            event["dur"] = (OVERHEAD_S + profiled[event["name"]] * 3.0) * 1e6
    calibration = calibrate(job, 1, STREAMING, profiled)
    spent = sum(OVERHEAD_S + profiled[n] * (3.0 if n in small else FACTOR) for n in profiled)
    overhead = calibration.task_overhead_us * 1e-6
    modelled = sum(calibration.compute_factor * kernel + overhead for kernel in profiled.values())
    assert modelled == pytest.approx(spent, rel=1e-9)
    assert FACTOR < calibration.compute_factor < 1.1 * FACTOR
    assert small and len(small) > len(profiled) / 2


def test_a_fit_below_zero_overhead_is_refitted_through_the_origin():
    job, profiled = synthetic_job("seed-lcn-small", 8)
    for event in job.trace["traceEvents"]:
        event["dur"] = profiled[event["name"]] * 2e6  # twice the profile, no overhead
    calibration = calibrate(job, 1, STREAMING, profiled)
    assert calibration.task_overhead_us == pytest.approx(0.0, abs=1e-6)
    assert calibration.compute_factor == pytest.approx(2.0, rel=1e-9)


def test_the_table_gives_both_predictions_and_failed_jobs():
    row = {
        "network": "seed-lcn-small", "batch": 64, "ranks": 2, "strategy": "model",
        "measured_s": 0.010, "predicted_s": 0.009, "error": -0.1, "flop_model_s": 0.005,
        "flop_model_error": -0.5, "bytes_per_step": 1_854_004,
    }  # fmt: skip
    failed = {"network": "seed-lcn", "batch": 4, "ranks": 4, "strategy": "data", "failed": "oom"}
    report = {
        "cores": 2,
        "link": {"latency_us": 2.3, "gbytes_per_s": 12.6},
        "results": [row, failed],
    }
    lines = format_table(report).splitlines()
    assert "FLOP model" in lines[1]
    assert lines[2].split() == [
        "seed-lcn-small", "64", "2", "model", "0.0100s", "0.0090s", "-10.0%", "0.0050s", "-50.0%",
        "1,854,004",
    ]  # fmt: skip
    assert lines[3].endswith("failed: oom")


def test_best_jobs_lengthen_short_jobs_go_round_robin_and_keep_the_fastest(monkeypatch, tmp_path):
    """A fake `run_job`: job "short" takes 10 ms a step, "long" and "few" 0.5 s, "broken"
    fails. Each run's step is the base times the next factor of its job's sequence. "long" is
    given enough steps; "few" times 1.5 s, but in fewer than `MIN_TIMED_STEPS` steps."""
    base = {"short": 0.010, "long": 0.5, "few": 0.5}
    factors = {
        "short": iter([1.0, 1.3, 0.9, 1.1]),
        "long": iter([1.2, 1.0, 1.4]),
        "few": iter([0.8, 1.1, 1.0, 1.2]),
    }
    calls = []

    def fake_run_job(network, batch, ranks, strategy, steps, work, threads=None, traced=False):
        calls.append((network, steps))
        assert work.is_dir() and not any(work.iterdir())
        if network == "broken":
            raise LegionNNError(f"bench scaling: {network} failed: boom")
        seconds = base[network] * next(factors[network])
        return Job(network, batch, ranks, strategy, seconds, 0, {})

    monkeypatch.setattr(jobs, "run_job", fake_run_job)
    enough = WARMUP + MIN_TIMED_STEPS
    given = {"short": 8, "long": enough, "few": WARMUP + 3, "broken": 8}
    specs = [
        {"network": name, "batch": 4, "ranks": 1, "strategy": "data", "steps": steps}
        for name, steps in given.items()
    ]
    best = best_jobs(specs, 3, tmp_path, lambda line: None)
    short_steps = WARMUP + 100  # 1 s of 10 ms steps
    assert [spec["steps"] for spec in specs] == [short_steps, enough, enough, 8]
    # first runs; then round-robin: the short and few jobs' probes are discarded, the long
    # job's counts
    assert calls == [
        ("short", 8), ("long", enough), ("few", WARMUP + 3), ("broken", 8),
        ("short", short_steps), ("long", enough), ("few", enough),
        ("short", short_steps), ("long", enough), ("few", enough),
        ("short", short_steps), ("few", enough),
    ]  # fmt: skip
    assert best[0].step_seconds == pytest.approx(0.009)  # not the discarded probe's 0.010
    assert best[1].step_seconds == pytest.approx(0.5)
    assert best[2].step_seconds == pytest.approx(0.5)  # not the discarded probe's 0.4
    assert isinstance(best[3], LegionNNError)
    # the job kept carries every kept run's step, the discarded probes' not among them
    assert best[0].runs_s == pytest.approx((0.013, 0.009, 0.011))
    assert best[1].runs_s == pytest.approx((0.6, 0.5, 0.7))
    assert best[2].runs_s == pytest.approx((0.55, 0.5, 0.6))


def test_the_computing_share_is_the_median_steps_mean_over_ranks_of_kernel_time():
    """Each step's share is the ranks' mean kernel seconds over the step's time (its slowest
    rank's); the warm-up steps are left out; a log without the field gives None."""
    from bench.jobs import WARMUP, median_compute_fraction

    steps = [(9.0, 9.0, 0.0), (9.0, 9.0, 0.0), (1.0, 2.0, 0.5), (2.0, 2.0, 1.0), (1.0, 1.0, 0.9)]
    records = []
    for step, (a, b, compute) in enumerate(steps):
        for rank, seconds in ((0, a), (1, b)):
            records.append(
                {"step": step, "rank": rank, "seconds": seconds, "compute_seconds": compute}
            )
    assert WARMUP == 2
    assert median_compute_fraction(records) == pytest.approx(0.5)  # of 0.25, 0.5 and 0.9
    del records[-1]["compute_seconds"]
    assert median_compute_fraction(records) is None


def test_task_medians_read_one_ranks_steps_after_the_warm_up():
    from bench.calibration import task_medians
    from bench.jobs import WARMUP

    def event(rank, name, step, us, cat="compute"):
        return {"ph": "X", "pid": rank, "cat": cat, "name": name, "dur": us,
                "args": {"step": step}}  # fmt: skip

    events = [event(0, "a", s, 100 * (s + 1)) for s in range(WARMUP + 3)]
    events += [event(1, "a", s, 7) for s in range(WARMUP + 3)]
    events += [event(1, "b", WARMUP, 5), event(1, "b", WARMUP, 6), event(1, "c", WARMUP, 9, "wait")]
    trace = {"traceEvents": events}
    assert task_medians(trace) == {"a": pytest.approx(100 * (WARMUP + 2) * 1e-6)}
    assert task_medians(trace, 1) == {"a": pytest.approx(7e-6), "b": pytest.approx(11e-6)}
