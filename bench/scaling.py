"""`legion-nn bench scaling`: measured step time on 1, 2 and 4 ranks beside the cost model's.

For each network (at a reduced batch), rank count and strategy, real `mpiexec -n R legion-nn
train` jobs run at least `MIN_TIMED_S` of steps and `MIN_TIMED_STEPS` steps on synthetic data
with `--log-json` (and plain SGD, so that four data-parallel replicas of seed-lcn fit in
memory). A job's step time is the median over its steps after the first two (compilation and
first touch) of the slowest rank's step; each job runs `repeat` times and the fastest run
counts (`best_jobs` says why). The bytes are the sum over ranks of one step's `bytes_sent`
(equal to `bytes_planned`).

The prediction is the cost model's step time (`partitioner.cost.plan_cost`) with each task's
compute measured rather than modelled, on a machine calibrated from what this benchmark measures,
plus the training loop's time outside the tasks:

- compute: `bench.task_profile` runs each rank's pieces of each task of the job's plan with the
  runtime's kernels, in this process, on the rank's thread count, and the busiest rank's sum is
  the task's compute (FlexFlow's simulator measures each operator configuration the same way). A
  kernel's rate depends on its piece: on one thread, seed-lcn-small's L1 weight gradient runs at
  about 60% of its whole-layer rate on half the output channels (a model-parallel piece), at its
  whole-layer rate on half the batch, and 25% above it on half the rows, which a FLOP model at
  one rate per op cannot see. Oversubscribed ranks time-share the cores: each runs at the fraction
  cores/(R·threads) of its speed;
- the runtime's fixed cost per task (dispatch, views, bookkeeping) and the factor by which a
  kernel in a running step is slower than in the profile (its operands come from further out in
  the memory hierarchy): both fitted to a 1-rank job's trace, each task's time against its
  profiled kernels (`calibrate`). One job per thread count the rank counts use (2 threads for 1
  rank, 1 for 2 and 4 ranks on this 2-core machine);
- memory bandwidth, for the local passes of messages and collectives (packing, unpacking,
  adding): what the profile's weight-sized zeroing reaches where there is any (seed-lcn's
  gradients: about half a streaming add's rate), else this process streaming `a + b -> c` over
  256 MB arrays;
- the link: latency and bandwidth from a two-rank ping-pong (`runtime.mpi_transport.pingpong`).

Each row also gives the prediction of the FLOP model alone (`flop_model_s`): the same machine,
with every op at the rate the 1-rank trace gives it (its FLOPs over its time less the overhead,
per tied or untied pass) and memory-bound tasks at their bytes over the bandwidth.

The goal is a prediction within 20% at 1 and 2 ranks. At 1 rank the prediction is a separate
run's profile and calibration, so the 1-rank error measures how stable a run is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.calibration import Calibration, calibrate, memory_bandwidth
from bench.jobs import MIN_TIMED_S, MIN_TIMED_STEPS, OPTIMIZER, best_jobs
from bench.task_profile import profile_as_run, sample_step
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import Plan, build_plan
from partitioner.strategy import BUILTIN, builtin
from runtime.launch import host_cores

DEFAULT_CASES = (("seed-lcn-small", 64), ("seed-lcn", 4))
DEFAULT_RANKS = (1, 2, 4)
STRATEGIES = BUILTIN


def pingpong() -> tuple[float, float]:
    """(latency s, seconds per byte) between two ranks of this machine."""
    command = ["mpiexec", "-n", "2", sys.executable, "-m", "runtime.mpi_transport", "pingpong"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if result.returncode != 0:
        raise LegionNNError(f"bench scaling: ping-pong failed: {result.stderr.strip()[-200:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data["latency_s"], data["seconds_per_byte"]


def rank_threads(ranks: int, cores: int) -> int:
    """The Numba threads each of `ranks` ranks on `cores` cores runs (`share_cores`)."""
    return max(1, cores // ranks)


@dataclass
class Prediction:
    #: with each task's compute profiled
    seconds: float
    #: with each op at its calibrated rate
    flop_model_seconds: float


class Predictor:
    """Predicted step times of one network's jobs, from one sample step's values, with the
    profiles of pieces shared between the plans that have them."""

    def __init__(self, network: str, batch: int, cores: int, link: tuple[float, float]) -> None:
        self.graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
        self.cores, self.link = cores, link
        self.sample = sample_step(self.graph)
        self.cache: dict = {}

    def plan(self, ranks: int, strategy: str) -> Plan:
        return build_plan(self.graph, builtin(self.graph, strategy, ranks), ranks)

    def profile(self, plan: Plan, threads: int) -> dict[str, float]:
        return profile_as_run(self.graph, plan, threads, self.sample, self.cache)

    def predict(self, ranks: int, strategy: str, calibration: Calibration) -> Prediction:
        plan = self.plan(ranks, strategy)
        profiled = self.profile(plan, calibration.threads)
        # Oversubscribed ranks time-share the cores: each runs at this fraction of its speed.
        share = min(1.0, self.cores / (ranks * calibration.threads))
        latency, per_byte = self.link
        rates = calibration.op_gflops
        machine = Machine(
            rank_gflops=calibration.compute_gflops * share,
            link_gbytes_per_s=1.0 / per_byte / 1e9,
            latency_us=latency * 1e6,
            rank_memory_gib=1e6,
            op_gflops={key: rate * share for key, rate in rates.items()},
            memory_gbytes_per_s=calibration.memory_gbytes_per_s * share,
            task_overhead_us=calibration.task_overhead_us / share,
        )
        loop = calibration.loop_seconds / share
        factor = calibration.compute_factor
        measured = {name: factor * seconds / share for name, seconds in profiled.items()}
        return Prediction(
            plan_cost(self.graph, plan, machine, measured).step_seconds + loop,
            plan_cost(self.graph, plan, machine).step_seconds + loop,
        )


def run_scaling(
    cases=DEFAULT_CASES,
    ranks=DEFAULT_RANKS,
    strategies=STRATEGIES,
    steps: int = 8,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every job of a network runs before its predictions are made: the prediction holds the
    whole network's tensors in this process, which the jobs need the memory for."""
    say = progress or (lambda line: None)
    cores = host_cores()
    say("ping-pong between two ranks; memory bandwidth")
    link = pingpong()
    bandwidth = memory_bandwidth()
    rows, calibrations = [], []
    with tempfile.TemporaryDirectory(prefix="legion-nn-scaling-") as tmp:
        for network, batch in cases:
            base = {"network": network, "batch": batch, "steps": steps}
            thread_counts = sorted({rank_threads(count, cores) for count in ranks}, reverse=True)
            specs = [
                {**base, "ranks": 1, "strategy": "data", "threads": threads, "traced": True}
                for threads in thread_counts
            ]
            cases_run = [
                (count, strategy)
                for count in ranks
                for strategy in (strategies if count > 1 else ("data",))
            ]
            specs += [
                {**base, "ranks": count, "strategy": strategy} for count, strategy in cases_run
            ]
            results = best_jobs(specs, repeat, Path(tmp) / network, say)
            calibration_jobs = dict(zip(thread_counts, results[: len(thread_counts)]))
            for threads, job in calibration_jobs.items():
                if isinstance(job, LegionNNError):
                    raise job  # without its calibration no row of the network can be predicted
            calibration_steps = {
                spec["threads"]: spec["steps"] for spec in specs if "threads" in spec
            }
            jobs = [
                (count, strategy, job, spec["steps"])
                for (count, strategy), job, spec in zip(
                    cases_run, results[len(thread_counts) :], specs[len(thread_counts) :]
                )
            ]
            say(f"{network} batch {batch}: profiling each plan's pieces")
            predictor = Predictor(network, batch, cores, link)
            by_threads = {}
            for threads, job in calibration_jobs.items():
                profiled = predictor.profile(predictor.plan(1, "data"), threads)
                by_threads[threads] = calibrate(job, threads, bandwidth, profiled)
                calibrations.append(
                    {"network": network, "batch": batch, "steps": calibration_steps[threads]}
                    | {"step_s": job.step_seconds}
                    | {"profiled_compute_s": sum(profiled.values())}
                    | asdict(by_threads[threads])
                )
            for count, strategy, job, job_steps in jobs:
                if isinstance(job, LegionNNError):
                    rows.append(_failed(network, batch, count, strategy, str(job)))
                    continue
                calibration = by_threads[rank_threads(count, cores)]
                predicted = predictor.predict(count, strategy, calibration)
                rows.append(
                    {
                        "network": network,
                        "batch": batch,
                        "ranks": count,
                        "strategy": strategy,
                        "steps": job_steps,
                        "measured_s": job.step_seconds,
                        "measured_runs_s": list(job.runs_s),
                        "predicted_s": predicted.seconds,
                        "error": predicted.seconds / job.step_seconds - 1.0,
                        "flop_model_s": predicted.flop_model_seconds,
                        "flop_model_error": predicted.flop_model_seconds / job.step_seconds - 1.0,
                        "bytes_per_step": job.bytes_per_step,
                    }
                )
            del predictor
    return {
        "cores": cores,
        "min_steps": steps,
        "min_timed_s": MIN_TIMED_S,
        "min_timed_steps": MIN_TIMED_STEPS,
        "repeat": repeat,
        "link": {"latency_us": link[0] * 1e6, "gbytes_per_s": 1.0 / link[1] / 1e9},
        "memory_gbytes_per_s": bandwidth,
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
            f"{'predicted':>10s} {'error':>7s} {'FLOP model':>10s} {'error':>7s} "
            f"{'bytes/step':>12s}"
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
            f"{row['flop_model_s']:9.4f}s {row['flop_model_error']:+7.1%} "
            f"{row['bytes_per_step']:12,d}"
        )
    return "\n".join(lines) + "\n"
