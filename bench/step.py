"""`legion-nn bench step [NETWORK] [--batch B] [--json F]`: one training step against its roofline.

Side by side, in one run on this machine:

- the roofline, from first principles: each task of the step bounded by the longer of its FLOPs
  at the machine's SGEMM rate (`bench.kernels.sgemm_gflops`, the best of its own and of BLAS
  without a core-type pin) and the bytes its pieces must read and write
  (`partitioner.accounting.bytes_per_rank`: each rect once, twice for an update in place) at the
  machine's streaming bandwidth on all its threads (`bench.calibration.memory_bandwidth`); the
  step's roofline is their sum, less the zeroings the runtime elides (nothing must be moved to
  zero a gradient whose first contribution writes it). An update the runtime fuses into the
  kernel that computes its gradient (`RankTask.fused_into`) is bounded with that task: its
  parameter and state at the bandwidth, added to the task's own bound, with no gradient
  written or read (`_fuse_row`);
- the measured step: the executor `train` runs, in one process, on seeded random data, Adam
  (`train`'s default), the median of `STEPS` steps after `WARMUP`, and each task's median time
  from the step's trace; an SGEMM measured before and after each timed step gives each step its
  own roofline, and the median of those ratios is printed beside the step's over the roofline
  at the run's first SGEMM (`paired_ratio`);
- the peer, when PyTorch is installed: the same network written in PyTorch, untied filters by
  unfold and batched matmul over the output positions (the recipe of `bench kernels`), Adam,
  timed the same way (`bench.torch_peer`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from bench.calibration import memory_bandwidth
from bench.kernels import sgemm_ceiling, sgemm_gflops, unpinned_scale
from bench.timing import ceilings_beside
from legion_nn.graph import TaskGraph
from legion_nn.networks import load_network
from partitioner.accounting import bytes_per_rank, flops_per_rank
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.adapters import StepContext
from runtime.rank_executor import one_process
from runtime.tracing import Recorder

WARMUP, STEPS = 2, 5
OPTIMIZER = "adam"


def roofline(graph: TaskGraph, gflops: float, gbytes_per_s: float) -> list[dict]:
    """Per task of the one-rank step: its FLOPs, its bytes and its bound in seconds."""
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    rows = []
    for task, flops, moved in zip(
        graph.tasks, flops_per_rank(graph, plan), bytes_per_rank(graph, plan)
    ):
        compute, memory = float(flops[0]) / (gflops * 1e9), float(moved[0]) / (gbytes_per_s * 1e9)
        rows.append(
            {
                "task": task.name,
                "flops": float(flops[0]),
                "bytes": float(moved[0]),
                "bound_s": max(compute, memory),
                "bound_by": "compute" if compute >= memory else "memory",
            }
        )
    return rows


def _inputs(graph: TaskGraph, network, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if network.tokens:  # token ids, and a target per token
        dims = (batch, *network.input)
        return rng.integers(0, network.vocab, dims).astype(np.int32), rng.integers(
            0, network.classes, dims
        ).astype(np.int32)
    x = rng.standard_normal((batch, *network.input)).astype(np.float32)
    return x, rng.integers(0, network.classes, batch).astype(np.int32)


class Measured(NamedTuple):
    """What `measure` times of the step."""

    #: the median step in seconds
    step: float
    #: the median of its tasks' summed seconds (each step's sum within that step, so the
    #: medians keep the order)
    tasks: float
    #: each task's median seconds
    per_task: dict[str, float]
    #: the zeroings the runtime elides (their first contribution writes: `RankTask.elided`)
    elided: set[str]
    #: the updates it fuses into the task that computes their gradient (`RankTask.fused_into`),
    #: by name, with that task's
    fused: dict[str, str]
    #: every timed step's seconds, in order
    steps: list[float]


def measure(graph: TaskGraph, network, batch: int, beside: Callable[[], None] | None = None):
    """The step as the executor runs it, timed (`Measured`); `beside` is called before the
    first timed step and after each (the SGEMM measured beside each step: `paired_ratio`)."""
    x, y = _inputs(graph, network, batch)
    recorder = Recorder(0)
    executor = one_process(recorder=recorder)
    steps, tasks, per_task = [], [], defaultdict(list)
    for step in range(WARMUP + STEPS):
        if beside is not None and step == WARMUP:
            beside()
        recorder.events.clear()
        start = time.perf_counter()
        executor.run(graph, StepContext(step, inputs=x, labels=y))
        if step >= WARMUP:
            steps.append(time.perf_counter() - start)
            computed = [e for e in recorder.events if e["cat"] == "compute"]
            tasks.append(sum(event["dur"] for event in computed) * 1e-6)
            for event in computed:
                per_task[event["name"]].append(event["dur"] * 1e-6)
            if beside is not None:
                beside()
    program = executor.prepare(graph).step
    elided = {rt.task.name for rt in program.tasks if rt.elided}
    fused = {
        rt.task.name: program.tasks[rt.fused_into].task.name
        for rt in program.tasks
        if rt.fused_into is not None
    }
    return Measured(
        statistics.median(steps),
        statistics.median(tasks),
        {k: statistics.median(v) for k, v in per_task.items()},
        elided,
        fused,
        steps,
    )


def step_rows(graph: TaskGraph, gflops: float, gbytes_per_s: float, measured: Measured) -> list:
    """The roofline's rows (`roofline`) as the runtime runs the step: the zeroings it elides
    bound at nothing, the updates it fuses bound with their gradients' tasks (`_fuse_row`),
    each row with its task's measured median."""
    rows = roofline(graph, gflops, gbytes_per_s)
    by_name = {row["task"]: row for row in rows}
    for row in rows:
        row["measured_s"] = measured.per_task.get(row["task"], 0.0)
        if row["task"] in measured.elided:  # no bytes must move: the first contribution writes
            row["bound_s"], row["bound_by"] = 0.0, "elided"
    for update, into in measured.fused.items():
        _fuse_row(graph, by_name[update], by_name[into], gflops, gbytes_per_s)
    return rows


def paired_ratio(steps: list[float], ceilings: list[float], bound: Callable[[float], float]):
    """The median over timed steps of each step's seconds over its roofline (`bound`, of an
    SGEMM rate) at the faster of the SGEMMs measured just before and after it
    (`timing.ceilings_beside`)."""
    return statistics.median(
        step / bound(rate) for step, rate in zip(steps, ceilings_beside(ceilings))
    )


def run_step_benchmark(
    network_name: str, batch: int, progress: Callable[[str], None] | None = None
) -> dict:
    say = progress or (lambda line: None)
    network = load_network(network_name)
    graph = network.lower(batch=batch, optimizer=OPTIMIZER)
    say("the machine's ceilings: SGEMM and memory bandwidth")
    gflops, native = sgemm_ceiling()
    bandwidth = memory_bandwidth()
    say(f"{network_name} at batch {batch}: {WARMUP} + {STEPS} steps, an SGEMM beside each")
    ceilings: list[float] = []
    measured = measure(graph, network, batch, lambda: ceilings.append(sgemm_gflops(repeat=3)))
    rows = step_rows(graph, gflops, bandwidth, measured)
    unpinned = unpinned_scale(native, ceilings)

    def bound(rate: float) -> float:
        return sum(r["bound_s"] for r in step_rows(graph, rate * unpinned, bandwidth, measured))

    step, tasks = measured.step, measured.tasks
    out = {
        "network": network_name,
        "batch": batch,
        "optimizer": OPTIMIZER,
        "sgemm_gflops": gflops,
        "memory_gbytes_per_s": bandwidth,
        "roofline_s": sum(r["bound_s"] for r in rows),
        "measured_s": step,
        "sgemm_beside_gflops": [rate * unpinned for rate in ceilings],
        "paired_roofline_ratio": paired_ratio(measured.steps, ceilings, bound),
        "tasks_s": tasks,
        "tasks": rows,
    }
    from bench.kernels import torch_available

    if torch_available():
        from bench.torch_peer import peer_step_seconds

        say(f"PyTorch's {network_name} at batch {batch}")
        out["torch_s"] = peer_step_seconds(network, batch, WARMUP, STEPS)
    return out


def _fuse_row(graph: TaskGraph, update: dict, into: dict, gflops: float, gbytes_per_s: float):
    """Move a fused update's bound into the row of the task that runs it. The gradient is
    neither written nor read: that task's own bound is taken without its write, and the
    update's part is the parameter and its state, read and written, at the memory bandwidth,
    added to it. The roofline stays a sum of each part's bound; that the kernel overlaps the
    two is what it gains."""
    task = graph.task(update["task"])
    gradient = graph.tensors[task.requirement("gradient").tensor].nbytes
    # the task reduced into the gradient (read and written, `bytes_per_rank`); the update read it
    own_bytes, step_bytes = into["bytes"] - 2 * gradient, update["bytes"] - gradient
    own = max(into["flops"] / (gflops * 1e9), own_bytes / (gbytes_per_s * 1e9))
    into["bound_s"] = own + step_bytes / (gbytes_per_s * 1e9)
    into["bytes"] = own_bytes + step_bytes
    into["flops"] += update["flops"]
    into["fused"] = update["task"]
    update.update(bytes=0.0, flops=0.0, bound_s=0.0, bound_by="fused", fused_into=into["task"])


def _note(row: dict) -> str:
    if row["bound_by"] == "fused":
        return f"  fused into {row['fused_into']}"
    note = {"compute": "", "memory": "  memory-bound", "elided": "  elided"}[row["bound_by"]]
    return note + (f"  with {row['fused']}" if "fused" in row else "")


def format_table(report: dict) -> str:
    lines = [
        (
            f"{report['network']} at batch {report['batch']}, {report['optimizer']}: SGEMM "
            f"{report['sgemm_gflops']:.1f} GFLOP/s, memory {report['memory_gbytes_per_s']:.1f} GB/s"
        ),
        f"{'task':40s} {'GFLOP':>8s} {'MB':>9s} {'bound ms':>9s} {'ms':>9s} {'x bound':>9s}",
    ]
    for row in sorted(report["tasks"], key=lambda r: -r["measured_s"]):
        ratio = row["measured_s"] / row["bound_s"] if row["bound_s"] else float("nan")
        lines.append(
            f"{row['task']:40s} {row['flops'] / 1e9:8.3f} {row['bytes'] / 1e6:9.1f} "
            f"{row['bound_s'] * 1e3:9.3f} {row['measured_s'] * 1e3:9.3f} {ratio:9.3g}" + _note(row)
        )
    step, bound = report["measured_s"], report["roofline_s"]
    lines.append(
        f"step: measured {step:.4f} s, roofline {bound:.4f} s ({step / bound:.2f}x); its tasks "
        f"{report['tasks_s']:.4f} s, the rest {step - report['tasks_s']:.4f} s"
    )
    if "paired_roofline_ratio" in report:
        beside = report["sgemm_beside_gflops"]
        lines.append(
            f"paired: each step over its roofline at the SGEMM measured beside it "
            f"({min(beside):.0f}-{max(beside):.0f} GFLOP/s), median "
            f"{report['paired_roofline_ratio']:.2f}x"
        )
    if "torch_s" in report:
        lines.append(
            f"PyTorch peer: {report['torch_s']:.4f} s a step ({report['torch_s'] / step:.1f}x ours)"
        )
    else:
        lines.append("PyTorch peer: not installed (pip install torch==2.13.0)")
    return "\n".join(lines) + "\n"
