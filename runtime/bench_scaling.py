"""`legion-nn bench scaling`: measured step time on 1, 2 and 4 ranks beside the cost model's.

For each network (at a reduced batch), rank count and strategy, one real `mpiexec -n R legion-nn
train` job runs a few steps on synthetic data with `--log-json` and `--trace`. The measured step
time is the median over rank 0's steps after the first two (compilation and first-touch); the
bytes are the sum over ranks of one step's `bytes_sent` (equal to `bytes_planned`).

The prediction is the cost model's step time (`partitioner.cost.plan_cost`) on a machine
calibrated from what this benchmark measures, plus the runtime's fixed cost per step:

- per-op throughput: from the 1-rank job's trace, each op's measured compute time against its
  FLOPs (`partitioner.accounting`), per core; a rank's throughput is its share of the cores
  (R ranks on C cores get C/R each; oversubscribed ranks time-share);
- the link: latency and bandwidth from a two-rank ping-pong of 8 B to 4 MiB messages;
- the fixed cost: what the 1-rank job spends per step beyond the FLOPs the model prices: data
  loading, zeroing, elementwise ops priced at nearly zero FLOPs, Python dispatch per task. It is
  charged per task, scaled by each rank's share of the tasks' elements.

The goal is a prediction within 20% at 1 and 2 ranks. At 1 rank the prediction is the calibration
itself, so the 1-rank error only checks that the median is stable.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.accounting import task_flops
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.distributed import host_cores

DEFAULT_CASES = (("seed-lcn-small", 64), ("seed-lcn", 4))
#: plain SGD keeps no optimizer state, so that four data-parallel replicas of seed-lcn's 1.2 GB of
#: weights (with their gradients and reduction buffers) fit in a 24 GB machine
OPTIMIZER = "sgd"
DEFAULT_RANKS = (1, 2, 4)
STRATEGIES = ("data", "model", "spatial")
WARMUP = 2


@dataclass
class Job:
    network: str
    batch: int
    ranks: int
    strategy: str
    step_seconds: float
    bytes_per_step: int
    trace: dict


def run_job(
    network: str,
    batch: int,
    ranks: int,
    strategy: str,
    steps: int,
    work: Path,
    threads: int | None = None,
    traced: bool = False,
) -> Job:
    """One `mpiexec` job; `threads` caps each rank's Numba threads (default: its share).

    Only a `traced` job writes a trace: rank 0 gathers every rank's events between steps, which
    delays the next step's first exchange, so the timed jobs run without one."""
    log, trace = work / "log.jsonl", work / "trace.json"
    env = dict(os.environ)
    if threads is not None:
        env["NUMBA_NUM_THREADS"] = str(threads)
    command = [
        "mpiexec", "-n", str(ranks), sys.executable, "-m", "legion_nn.cli", "train", network,
        "--data", "synthetic", "--batch", str(batch), "--steps", str(steps),
        "--strategy", strategy, "--optimizer", OPTIMIZER, "--no-progress",
        "--log-json", str(log), *(["--trace", str(trace)] if traced else []),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=1800, env=env
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise LegionNNError(
            f"bench scaling: {network} on {ranks} ranks ({strategy}) failed: {last}"
        )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps_seen = [r for r in records if "step" in r]
    # A step takes as long as its slowest rank.
    slowest: dict[int, float] = defaultdict(float)
    for r in steps_seen:
        if r["step"] >= WARMUP:
            slowest[r["step"]] = max(slowest[r["step"]], r["seconds"])
    last_step = max(r["step"] for r in steps_seen)
    sent = sum(r["bytes_sent"] for r in steps_seen if r["step"] == last_step)
    return Job(
        network,
        batch,
        ranks,
        strategy,
        statistics.median(slowest.values()),
        sent,
        json.loads(trace.read_text()) if traced else {},
    )


def best_job(repeat: int, *args, **kwargs) -> Job:
    """`run_job` `repeat` times; the run with the fastest median step.

    This machine's step times drift between runs and within them: a 2-rank job here spends
    stretches of a second or more at twice its usual step time, with nothing else running and
    each rank bound to its own core (the host's other tenants). The best of a few runs is the
    machine as the model sees it, and the same rule is used for the calibration jobs."""
    runs = []
    for attempt in range(repeat):
        work = Path(args[5]) / f"run-{attempt}"
        work.mkdir()
        runs.append(run_job(*args[:5], work, *args[6:], **kwargs))
    return min(runs, key=lambda job: job.step_seconds)


def pingpong() -> tuple[float, float]:
    """(latency s, seconds per byte) between two ranks of this machine."""
    command = ["mpiexec", "-n", "2", sys.executable, "-m", "runtime.mpi_executor", "pingpong"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if result.returncode != 0:
        raise LegionNNError(f"bench scaling: ping-pong failed: {result.stderr.strip()[-200:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data["latency_s"], data["seconds_per_byte"]


def _step_events(trace: dict, rank: int = 0) -> list[dict]:
    return [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
        and e.get("pid") == rank
        and e.get("cat") == "compute"
        and isinstance(e["args"].get("step"), int)  # not the "eval" passes
        and e["args"]["step"] >= WARMUP
    ]


@dataclass
class Calibration:
    """What one rank does per step at `threads` Numba threads, from a 1-rank job."""

    threads: int
    #: GFLOP/s of each op that the cost model prices by its FLOPs
    op_gflops: dict[str, float]
    #: seconds per step of each task the model prices at no FLOPs (zeroing, loading), by name
    zero_flop_seconds: dict[str, float]
    #: seconds per step outside every task: the training loop, data loading, logging
    loop_seconds: float


def calibrate(job: Job, threads: int) -> Calibration:
    graph = load_network(job.network).lower(batch=job.batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    flops = {name: sum(per.values()) for name, per in task_flops(graph, plan).items()}
    ops = {task.name: task.op for task in graph.tasks}
    events = _step_events(job.trace)
    steps = len({e["args"]["step"] for e in events}) or 1
    seconds: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)
    zero_flop: dict[str, float] = defaultdict(float)
    for event in events:
        name = event["name"]
        spent = event["dur"] * 1e-6 / steps
        if flops.get(name, 0.0) > 0:
            seconds[ops[name]] += spent
            work[ops[name]] += flops[name] / steps
        else:
            zero_flop[name] += spent
    rates = {op: work[op] / seconds[op] / 1e9 for op in work if seconds[op] > 0}
    in_tasks = sum(seconds.values()) + sum(zero_flop.values())
    return Calibration(threads, rates, dict(zero_flop), max(job.step_seconds - in_tasks, 0.0))


def rank_threads(ranks: int, cores: int) -> int:
    """The Numba threads each of `ranks` ranks on `cores` cores runs (`share_cores`)."""
    return max(1, cores // ranks)


def predict(
    network: str,
    batch: int,
    ranks: int,
    strategy: str,
    calibration: Calibration,
    link: tuple[float, float],
    cores: int,
) -> float:
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, strategy, ranks), ranks)
    # Oversubscribed ranks time-share the cores: each runs at this fraction of its speed.
    share = min(1.0, cores / (ranks * calibration.threads))
    latency, per_byte = link
    rates = calibration.op_gflops
    machine = Machine(
        rank_gflops=min(rates.values()) * share,
        link_gbytes_per_s=1.0 / per_byte / 1e9,
        latency_us=latency * 1e6,
        rank_memory_gib=1e6,
        op_gflops={op: rate * share for op, rate in rates.items()},
    )
    cost = plan_cost(graph, plan, machine)
    # A zero-FLOP task's time follows the busiest rank's share of its elements.
    fixed = calibration.loop_seconds
    for task, task_plan in zip(graph.tasks, plan.tasks):
        measured = calibration.zero_flop_seconds.get(task.name)
        if measured is None:
            continue
        volume = task.space.volume or 1
        biggest = max((p.rect.volume for p in task_plan.pieces), default=volume)
        fixed += measured * max(biggest / volume, 1.0 / ranks)
    return cost.step_seconds + fixed / share


def run_scaling(
    cases=DEFAULT_CASES,
    ranks=DEFAULT_RANKS,
    strategies=STRATEGIES,
    steps: int = 8,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    say = progress or (lambda line: None)
    cores = host_cores()
    say("ping-pong between two ranks")
    link = pingpong()
    rows, calibrations = [], []
    with tempfile.TemporaryDirectory(prefix="legion-nn-scaling-") as tmp:
        for network, batch in cases:
            by_threads: dict[int, Calibration] = {}
            for threads in sorted({rank_threads(count, cores) for count in ranks}, reverse=True):
                say(f"{network} batch {batch}: calibration, 1 rank on {threads} thread(s)")
                work = Path(tmp) / f"{network}-calibration-{threads}"
                work.mkdir()
                job = best_job(repeat, network, batch, 1, "data", steps, work, threads, traced=True)
                by_threads[threads] = calibrate(job, threads)
                calibrations.append(
                    {"network": network, "batch": batch, "step_s": job.step_seconds}
                    | asdict(by_threads[threads])
                )
            for count in ranks:
                for strategy in strategies if count > 1 else ("data",):
                    say(f"{network} batch {batch}: {count} rank(s), {strategy}")
                    work = Path(tmp) / f"{network}-{count}-{strategy}"
                    work.mkdir()
                    try:
                        job = best_job(repeat, network, batch, count, strategy, steps, work)
                    except LegionNNError as exc:  # a job that fails is a row, not the end
                        say(str(exc))
                        rows.append(_failed(network, batch, count, strategy, str(exc)))
                        continue
                    calibration = by_threads[rank_threads(count, cores)]
                    predicted = predict(network, batch, count, strategy, calibration, link, cores)
                    rows.append(
                        {
                            "network": network,
                            "batch": batch,
                            "ranks": count,
                            "strategy": strategy,
                            "measured_s": job.step_seconds,
                            "predicted_s": predicted,
                            "error": predicted / job.step_seconds - 1.0,
                            "bytes_per_step": job.bytes_per_step,
                        }
                    )
    return {
        "cores": cores,
        "steps": steps,
        "repeat": repeat,
        "link": {"latency_us": link[0] * 1e6, "gbytes_per_s": 1.0 / link[1] / 1e9},
        "calibrations": calibrations,
        "results": rows,
    }


def _failed(network: str, batch: int, ranks: int, strategy: str, why: str) -> dict:
    return {
        "network": network,
        "batch": batch,
        "ranks": ranks,
        "strategy": strategy,
        "failed": why.split(": ", 2)[-1],
    }


def format_table(report: dict) -> str:
    link = report["link"]
    lines = [
        (
            f"{report['cores']} cores; link {link['latency_us']:.1f} us, "
            f"{link['gbytes_per_s']:.2f} GB/s (ping-pong)"
        ),
        (
            f"{'network':16s} {'batch':>5s} {'R':>2s} {'strategy':8s} {'measured':>10s} "
            f"{'predicted':>10s} {'error':>7s} {'bytes/step':>12s}"
        ),
    ]
    for row in report["results"]:
        if "failed" in row:
            lines.append(
                f"{row['network']:16s} {row['batch']:5d} {row['ranks']:2d} {row['strategy']:8s} "
                f"failed: {row['failed']}"
            )
            continue
        lines.append(
            f"{row['network']:16s} {row['batch']:5d} {row['ranks']:2d} {row['strategy']:8s} "
            f"{row['measured_s']:9.4f}s {row['predicted_s']:9.4f}s {row['error']:+7.1%} "
            f"{row['bytes_per_step']:12,d}"
        )
    return "\n".join(lines) + "\n"
