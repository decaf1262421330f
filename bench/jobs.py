"""Timed training jobs for the scaling benchmarks: `legion-nn train` under a launcher
(`mpiexec -n R`, or the emulated cluster's `cluster run`), its step time the median over its
steps after the first `WARMUP` (compilation and first touch) of the slowest rank's step, its
bytes a full batch's sum over ranks of `bytes_sent` (equal to `bytes_planned`); and `best_jobs`,
which runs each job a few times, round-robin, and keeps the fastest.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from legion_nn.errors import LegionNNError


def command_environment(bytecode: bool = True) -> dict[str, str]:
    """The environment of a command whose whole wall time is measured, as a user's shell runs
    it: Python writes its modules' bytecode on a first run and reads it on the next, unless
    `PYTHONDONTWRITEBYTECODE` is set, which a user's shell does not set by default (and a
    sandbox may): it is dropped here, or set where `bytecode` is False."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    if not bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


#: plain SGD keeps no optimizer state, so that four data-parallel replicas of seed-lcn's 1.2 GB of
#: weights (with their gradients and reduction buffers) fit in a 24 GB machine
OPTIMIZER = "sgd"
WARMUP = 2


def failure_line(stderr: str) -> str:
    """What a failed command's stderr says went wrong, in one line: its own error (the first line
    `legion-nn` prints, naming the command), not the launcher's last word after it (MPICH's
    `MPI_Abort` line, which every rank that ended the job prints), else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("legion-nn ")]
    return (own or lines or ["no output"])[0 if own else -1]


@dataclass
class Job:
    network: str
    batch: int
    ranks: int
    strategy: str
    step_seconds: float
    bytes_per_step: int
    trace: dict
    #: the median over steps of the mean share of a step a rank spent in its kernels
    compute_fraction: float | None = None
    #: `best_jobs`: the median step of every run of the job it kept, this one among them
    runs_s: tuple[float, ...] = ()


def run_job(
    network: str,
    batch: int,
    ranks: int,
    strategy: str,
    steps: int,
    work: Path,
    threads: int | None = None,
    traced: bool = False,
    launch: Sequence[str] | None = None,
    extra: Sequence[str] = (),
) -> Job:
    """One `mpiexec` job; `threads` caps each rank's Numba threads (default: its share);
    `launch` starts the ranks (default `mpiexec -n RANKS`; the emulated cluster's
    `runtime.cluster.job_command`); `extra` are more `train` arguments.

    Only a `traced` job writes a trace: rank 0 gathers every rank's events between steps, which
    delays the next step's first exchange, so the timed jobs run without one."""
    log, trace = work / "log.jsonl", work / "trace.json"
    env = dict(os.environ)
    if threads is not None:
        env["NUMBA_NUM_THREADS"] = str(threads)
    command = [
        *(launch if launch is not None else ["mpiexec", "-n", str(ranks)]),
        sys.executable, "-m", "cli", "train", network,
        "--data", "synthetic", "--batch", str(batch), "--steps", str(steps),
        "--strategy", strategy, "--optimizer", OPTIMIZER, "--no-progress", "--no-evaluation",
        "--log-json", str(log), *(["--trace", str(trace)] if traced else []), *extra,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=1800, env=env
    )
    if result.returncode != 0:
        raise LegionNNError(
            f"bench scaling: {network} on {ranks} ranks ({strategy}) failed: "
            f"{failure_line(result.stderr)}"
        )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps_seen = [r for r in records if "step" in r]
    # a full batch's bytes: the last step of an epoch may take a smaller batch
    sent_by_step: dict[int, int] = defaultdict(int)
    for r in steps_seen:
        sent_by_step[r["step"]] += r["bytes_sent"]
    sent = statistics.mode(sent_by_step.values())
    return Job(
        network,
        batch,
        ranks,
        strategy,
        median_step(records),
        sent,
        json.loads(trace.read_text()) if traced else {},
        median_compute_fraction(records),
    )


def log_records(log: io.StringIO) -> list[dict]:
    """The records of a `--log-json` log written to memory."""
    return [json.loads(line) for line in log.getvalue().splitlines()]


def median_step(records: list[dict]) -> float:
    """The median over a `--log-json` log's steps after `WARMUP` of the step's time, which is
    its slowest rank's."""
    slowest: dict[int, float] = defaultdict(float)
    for r in records:
        if "step" in r and r["step"] >= WARMUP:
            slowest[r["step"]] = max(slowest[r["step"]], r["seconds"])
    return statistics.median(slowest.values())


def median_compute_fraction(records: list[dict]) -> float | None:
    """The median over a `--log-json` log's steps after `WARMUP` of the mean over ranks of the
    share of the step (its slowest rank's time) each rank spent in its kernels
    (`compute_seconds`); None where the log has no such field."""
    steps: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if "step" in r and r["step"] >= WARMUP:
            steps[r["step"]].append(r)
    shares = []
    for ranks in steps.values():
        if any("compute_seconds" not in r for r in ranks):
            return None
        slowest = max(r["seconds"] for r in ranks)
        if slowest > 0:
            shares.append(sum(r["compute_seconds"] for r in ranks) / len(ranks) / slowest)
    return statistics.median(shares) if shares else None


#: a measured job times at least this long: a few steps of a small network would be a sample
#: of 50 ms, inside one of the machine's slow or fast stretches
MIN_TIMED_S = 1.0
#: and at least this many steps: the VM's slow stretches last a few steps of a large network
#: too (seed-lcn at batch 16 on 2 emulated hosts, 12 steps of 0.27-0.37 s, runs of 2-4 steps
#: at 0.34-0.37 s between runs at 0.27-0.30 s), so that the median of 4 could fall within one
#: and set the job's time: the same plan measured 0.273-0.280 s in one row and 0.306-0.356 s
#: in another in three matrices
MIN_TIMED_STEPS = 8


def best_jobs(specs: list[dict], repeat: int, work: Path, say: Callable[[str], None]) -> list:
    """Each job of `specs` (`run_job`'s keyword arguments) `repeat` times; per spec, the run with
    the fastest median step, or the `LegionNNError` of its first failure.

    This machine's step times drift between runs and within them: the same 1-rank job measured
    5.6 ms and, in a calibration run seconds before, 7.2 ms; a 2-rank job here spends stretches
    of a second or more at twice its usual step time, with nothing else running and each rank
    bound to its own core (the host's other tenants). So a job times at least `MIN_TIMED_S` of
    steps, and at least `MIN_TIMED_STEPS` steps: a first run with the spec's steps measures the
    step, and a job that timed less than that has its steps raised (the spec is updated) and
    that run discarded. The repeats go round-robin over the specs, so a job's runs are far
    apart in time and one slow stretch cannot take them all. The best of a few runs is the
    machine as the model sees it, for calibration jobs and measured jobs alike. The job kept
    carries every kept run's step (`Job.runs_s`): how far one job's runs lie apart is the
    machine's noise, beside which a prediction's error is read."""
    best: list = [None] * len(specs)
    runs_left = [repeat] * len(specs)
    steps: list[list[float]] = [[] for _ in specs]

    def run(index: int, label: str) -> Job | None:
        spec = specs[index]
        say(
            f"{spec['network']} batch {spec['batch']}: {spec['ranks']} rank(s), "
            f"{spec['strategy']}"
            + (f", {spec['threads']} thread(s), traced (calibration)" if spec.get("traced") else "")
            + f", {spec['steps']} steps, {label}"
        )
        where = work / f"job-{index}-{label.replace(' ', '-')}"
        where.mkdir(parents=True)
        try:
            return run_job(**spec, work=where)
        except LegionNNError as exc:  # a job that fails is a row, not the end
            say(str(exc))
            best[index] = exc
            return None

    for index, spec in enumerate(specs):
        probe = run(index, "first run")
        if probe is None:
            continue
        needed = max(MIN_TIMED_STEPS, math.ceil(MIN_TIMED_S / probe.step_seconds))
        if spec["steps"] - WARMUP >= needed:
            best[index] = probe
            runs_left[index] -= 1
            steps[index].append(probe.step_seconds)
        else:
            spec["steps"] = WARMUP + needed
    for attempt in range(repeat):
        for index in range(len(specs)):
            if runs_left[index] == 0 or isinstance(best[index], LegionNNError):
                continue
            runs_left[index] -= 1
            job = run(index, f"run {attempt + 1}")
            if job is None:
                continue
            steps[index].append(job.step_seconds)
            if best[index] is None or job.step_seconds < best[index].step_seconds:
                best[index] = job
    return [
        replace(job, runs_s=tuple(found)) if isinstance(job, Job) else job
        for job, found in zip(best, steps)
    ]
