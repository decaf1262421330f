"""The runtime's costs outside its kernels, fitted to a traced 1-rank training job: the factor
by which a kernel in a running step is slower than alone, the fixed cost per task, the memory
bandwidth its memory-bound tasks reach, and each op's rate for the FLOP model (`calibrate`).
`bench scaling` and `bench machine` both use it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from bench.jobs import OPTIMIZER, WARMUP, Job
from bench.timing import call_seconds
from legion_nn.ir import Task
from legion_nn.networks import load_network
from legion_nn.op_records import rate_passes
from partitioner.accounting import bytes_per_rank, task_flops
from partitioner.plan import build_plan
from partitioner.strategy import builtin


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
    """What one rank does per step at `threads` Numba threads, from a 1-rank job's trace and
    the profile of its plan."""

    threads: int
    #: GFLOP/s by the cost model's keys (op, pass, tied or untied), for the FLOP model's column
    op_gflops: dict[str, float]
    #: the rate at which this network's median FLOP runs: the median of `op_gflops` weighted by
    #: each key's FLOPs, so the GEMMs that carry them set it, not the memory-bound ops (whose
    #: "rates" are their few FLOPs over a time spent moving bytes)
    compute_gflops: float
    #: the bandwidth the runtime's memory-bound tasks reach (else `memory_bandwidth`)
    memory_gbytes_per_s: float
    #: the runtime's fixed cost per task
    task_overhead_us: float
    #: a task's kernels in a running job take this many times their profiled time
    compute_factor: float
    #: seconds per step outside every task: the training loop, logging
    loop_seconds: float


#: a zero-FLOP task moving this many bytes calibrates the memory bandwidth (`calibrate`)
_LARGE_BYTES = 64 * 2**20


def rate_keys(task: Task) -> tuple[str, ...]:
    """The `Machine.op_gflops` keys a task's measured time calibrates."""
    variant, _ = rate_passes(task)
    if not variant:
        return (f"{task.op}.{task.phase}",)
    if task.phase == "forward":
        return (f"{task.op}.forward.{variant}",)
    # a backward's measured time calibrates the rates of both of its passes
    return (f"{task.op}.backward_data.{variant}", f"{task.op}.backward_filter.{variant}")


@njit(nogil=True, parallel=True)
def _add(a, b, c):
    for i in prange(a.shape[0]):
        c[i] = a[i] + b[i]


@njit(nogil=True, parallel=True)
def _update_mix(p, g, m, v):
    for i in prange(p.shape[0]):
        mi = m[i] * np.float32(0.9) + g[i]
        vi = v[i] * np.float32(0.9) + g[i]
        m[i], v[i] = mi, vi
        p[i] += mi + vi


def buffer_pass_rates(megabytes: int = 256, repeat: int = 5) -> dict[str, float]:
    """GB/s of data of the runtime's own passes over its buffers (`runtime.step.local_passes`),
    each as it makes them, on one thread as NumPy does, over arrays far larger than the caches:
    a copy into a buffer (`dst[...] = src`: a message packed or unpacked, a window filled), an
    add into one (`dst += src`: a partial sum added in) and a zeroing (`dst.fill(0)`). The
    arrays are made and touched first (the runtime's buffers are the same memory every step) and
    hold random values; each rate is the median of `repeat` runs. On a 2-core AMD EPYC VM: copy
    8-16, add 11, zero 17-19 GB/s, where `memory_bandwidth`'s 42 GB/s of traffic had priced a
    copy's data at 21 GB/s."""
    n = megabytes * 2**20 // 4
    rng = np.random.default_rng(0)
    src, dst = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)

    def copy():
        dst[...] = src

    def add():
        dst[...] += src

    def zero():
        dst.fill(0)

    runs = (("copy", copy), ("add", add), ("zero", zero))
    return {
        kind: src.nbytes / statistics.median(call_seconds(run, repeat)) / 1e9 for kind, run in runs
    }


def memory_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """GB/s, counting each array an element touches once (as `bytes_per_rank` does), of the
    fastest of two streaming loops on all of Numba's threads over arrays far larger than the
    caches: `a + b -> c` (two reads and a write, the elementwise ops) and the optimizer's mix
    (four reads and three writes per element). The runtime's memory-bound kernels run on every
    core, so the ceiling does too: NumPy's one-thread add measured 35 GB/s here, where the
    optimizer's mix on two threads moved 60. The arrays hold random values, not constants:
    pages of equal values may be shared by the host (they read at 99 GB/s here). Each loop's rate is the median of
    `repeat` runs: a rare fast run (94 GB/s once, against 61-62 otherwise) is not the machine's."""
    n = megabytes * 2**20 // 4
    rng = np.random.default_rng(0)
    # uniform rather than normal values: as random, and drawn 5x faster (1 GiB of them)
    a, b, c, d = (rng.random(n, dtype=np.float32) for _ in range(4))
    rates = []
    for run, arrays, streams in ((_add, (a, b, c), 3), (_update_mix, (a, b, c, d), 7)):
        seconds = call_seconds(lambda run=run, arrays=arrays: run(*arrays), repeat)
        rates.append(streams * a.nbytes / statistics.median(seconds) / 1e9)
    return max(rates)


def calibrate(
    job: Job, threads: int, memory_gbytes_per_s: float, profiled: dict[str, float]
) -> Calibration:
    """Fit the model's per-task terms to a 1-rank trace and the profile of the same plan.

    Each task's traced time is modelled as `compute_factor` × its profiled kernels + the
    per-task overhead. The overhead is read off the small tasks, by a least-squares fit over
    the tasks in relative terms (`_fit_task_times`); the factor is then the one that makes the
    step's kernels sum to what the traced step spent in them (`_step_factor`). The factor is
    the difference between a kernel profiled on evicted caches (`cache_eviction.evict`)
    and the same kernel in a step, where some of its operands are still cached from the tasks
    before it (below 1: 0.76-0.96 for seed-lcn-small at batch 64 on one core); an overhead
    alone cannot carry it: it grows with the task. It also absorbs a profile that ran in a
    slower or faster stretch of the machine than the job. It is not the same for every task
    (profiled on warm caches, before the eviction): seed-lcn at batch 16 on one core traced its
    tenth-of-a-second kernels at 0.98-1.24 times their profiles and its sub-millisecond ones at
    1.4-3.4. A factor fitted task by task, each alike, took the small tasks' 1.43 and
    over-predicted the step by 17%; the step's own factor (1.15 there) is the large tasks',
    which carry a step and its pieces on a few ranks.

    Where some zero-FLOP tasks move `_LARGE_BYTES` or more (a weight-sized gradient zeroed),
    the bandwidth is theirs: their bytes over their profiled time times the factor. The
    runtime's passes over a weight reach less than a streaming add does, and messages and
    collectives of weight-sized gradients must be priced at the rate the runtime gets. Each
    FLOP-priced op's rate, for the FLOP model, is its FLOPs over its time less the overhead,
    summed over its tasks whose kernels were profiled (a fused update's ran in its gradient's:
    its own few microseconds read as 0.035 GFLOP/s); `compute_gflops`, the rate of an op no key
    prices, their median weighted by FLOPs."""
    graph = load_network(job.network).lower(batch=job.batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    flops = {name: sum(per.values()) for name, per in task_flops(graph, plan).items()}
    traffic = {t.name: float(b[0]) for t, b in zip(graph.tasks, bytes_per_rank(graph, plan))}
    tasks = {task.name: task for task in graph.tasks}
    spent = task_medians(job.trace)
    kernels = [profiled.get(name, 0.0) for name in spent]
    _, overhead = _fit_task_times(kernels, list(spent.values()))
    factor = _step_factor(kernels, list(spent.values()), overhead)
    large = [n for n in spent if not flops.get(n) and traffic.get(n, 0.0) >= _LARGE_BYTES]
    if large:
        moved = sum(traffic[name] for name in large)
        in_step = factor * sum(profiled[name] for name in large)
        memory_gbytes_per_s = moved / max(in_step, 1e-9) / 1e9
    seconds: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)
    for name, t in spent.items():
        # a task whose kernels run in another's (an update fused into its gradient's product)
        # spends only its bookkeeping here: its FLOPs over that time is no rate of its op
        if flops.get(name) and profiled.get(name, 0.0) > 0:
            for key in rate_keys(tasks[name]):
                seconds[key] += max(t - overhead, 1e-9)
                work[key] += flops[name]
    rates = {key: work[key] / seconds[key] / 1e9 for key in work}
    compute = _weighted_median(rates, work) if work else 1.0
    loop = max(job.step_seconds - sum(spent.values()), 0.0)
    return Calibration(threads, rates, compute, memory_gbytes_per_s, overhead * 1e6, factor, loop)


def task_medians(trace: dict, rank: int = 0) -> dict[str, float]:
    """Per task of `rank` in a job's trace, its median seconds over the steps after the warm-up
    (a long job's steps include each epoch's short last batch, which a mean would average in)."""
    by_step: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for event in _step_events(trace, rank):
        by_step[event["name"]][event["args"]["step"]] += event["dur"] * 1e-6
    return {name: statistics.median(per.values()) for name, per in by_step.items()}


def _weighted_median(values: dict[str, float], weights: dict[str, float]) -> float:
    """The value below and above which lie at most half of the weight."""
    ordered = sorted(values, key=values.__getitem__)
    half, seen = sum(weights[key] for key in ordered) / 2, 0.0
    for key in ordered:
        seen += weights[key]
        if seen >= half:
            return values[key]
    return values[ordered[-1]]


def _step_factor(profiled: list[float], spent: list[float], overhead: float) -> float:
    """The factor by which the tasks' profiled kernels sum to what they spent less `overhead`
    each: the ratio of the sums, so that the step is reproduced and the tasks that carry it
    set the factor."""
    kernels = sum(profiled)
    if kernels <= 0:
        return 1.0
    return max((sum(spent) - overhead * len(spent)) / kernels, 1e-3)


def _fit_task_times(profiled: list[float], spent: list[float]) -> tuple[float, float]:
    """(factor, overhead s): least squares of spent ≈ factor · profiled + overhead in relative
    terms (each task's residual over its time), with the overhead kept >= 0 (refitted through
    the origin where the free fit would go below).

    A task's time varies in proportion to it (the machine's slow and fast stretches), so an
    absolute fit lets the longest tasks' noise set the overhead: seed-lcn at batch 16, whose
    largest tasks take a tenth of a second, fitted 1 ms and 6 ms a task in two runs where its
    small tasks said 40-50 us. Weighted by 1/time, every task counts alike, and the overhead is
    read where it is most of the time."""
    if not spent:
        return 1.0, 0.0
    x, y = np.asarray(profiled, np.float64), np.asarray(spent, np.float64)
    weight = 1.0 / np.maximum(y, 1e-9)
    if len(x) >= 2 and np.ptp(x) > 0:
        design = np.stack([x, np.ones_like(x)], 1) * weight[:, None]
        (factor, overhead), *_ = np.linalg.lstsq(design, y * weight, rcond=None)
        if overhead >= 0 and factor > 0:
            return float(factor), float(overhead)
    wx, wy = x * weight, y * weight
    if wx @ wx > 0:
        return float(max(wx @ wy / (wx @ wx), 1e-3)), 0.0
    return 1.0, float(np.mean(y))
