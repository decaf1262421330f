"""`legion-nn bench step [NETWORK] [--batch B] [--json F]`: one training step against its roofline.

Side by side, in one run on this machine:

- the roofline, from first principles: each task of the step bounded by the longer of its FLOPs
  at the machine's SGEMM rate (`bench.kernels.sgemm_gflops`, the best of its own and of BLAS
  without a core-type pin) and the bytes its pieces must read and write
  (`partitioner.accounting.bytes_per_rank`: each rect once, twice for an update in place) at the
  machine's streaming bandwidth on all its threads (`bench.calibration.memory_bandwidth`); the
  step's roofline is their sum, less the zeroings the runtime elides (nothing must be moved to
  zero a gradient whose first contribution writes it);
- the measured step: the executor `train` runs, in one process, on seeded random data, Adam
  (`train`'s default), the median of `STEPS` steps after `WARMUP`, and each task's median time
  from the step's trace;
- the peer, when PyTorch is installed: the same network written in PyTorch, untied filters by
  unfold and batched matmul over the output positions (the recipe of `bench kernels`), Adam,
  timed the same way (`bench.torch_peer`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from bench.calibration import memory_bandwidth
from bench.kernels import sgemm_ceiling
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
    x = rng.standard_normal((batch, *network.input)).astype(np.float32)
    return x, rng.integers(0, network.classes, batch).astype(np.int32)


def measure(graph: TaskGraph, network, batch: int) -> tuple[float, dict[str, float], set[str]]:
    """The median step in seconds, each task's median seconds in it, and the zeroings the
    runtime elides (their first contribution writes: `RankTask.elided`)."""
    x, y = _inputs(graph, network, batch)
    recorder = Recorder(0)
    executor = one_process(recorder=recorder)
    steps, per_task = [], defaultdict(list)
    for step in range(WARMUP + STEPS):
        recorder.events.clear()
        start = time.perf_counter()
        executor.run(graph, StepContext(step, inputs=x, labels=y))
        if step >= WARMUP:
            steps.append(time.perf_counter() - start)
            for event in recorder.events:
                if event["cat"] == "compute":
                    per_task[event["name"]].append(event["dur"] * 1e-6)
    elided = {rt.task.name for rt in executor.prepare(graph).step.tasks if rt.elided}
    return (
        statistics.median(steps),
        {k: statistics.median(v) for k, v in per_task.items()},
        elided,
    )


def run_step_benchmark(
    network_name: str, batch: int, progress: Callable[[str], None] | None = None
) -> dict:
    say = progress or (lambda line: None)
    network = load_network(network_name)
    graph = network.lower(batch=batch, optimizer=OPTIMIZER)
    say("the machine's ceilings: SGEMM and memory bandwidth")
    gflops = sgemm_ceiling()
    bandwidth = memory_bandwidth()
    rows = roofline(graph, gflops, bandwidth)
    say(f"{network_name} at batch {batch}: {WARMUP} + {STEPS} steps")
    step, per_task, elided = measure(graph, network, batch)
    for row in rows:
        row["measured_s"] = per_task.get(row["task"], 0.0)
        if row["task"] in elided:  # no bytes must move: the first contribution writes
            row["bound_s"], row["bound_by"] = 0.0, "elided"
    out = {
        "network": network_name,
        "batch": batch,
        "optimizer": OPTIMIZER,
        "sgemm_gflops": gflops,
        "memory_gbytes_per_s": bandwidth,
        "roofline_s": sum(r["bound_s"] for r in rows),
        "measured_s": step,
        "tasks_s": sum(per_task.values()),
        "tasks": rows,
    }
    from bench.kernels import torch_available

    if torch_available():
        from bench.torch_peer import peer_step_seconds

        say(f"PyTorch's {network_name} at batch {batch}")
        out["torch_s"] = peer_step_seconds(network, batch, WARMUP, STEPS)
    return out


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
            f"{row['bound_s'] * 1e3:9.3f} {row['measured_s'] * 1e3:9.3f} {ratio:9.3g}"
            + {"compute": "", "memory": "  memory-bound", "elided": "  elided"}[row["bound_by"]]
        )
    step, bound = report["measured_s"], report["roofline_s"]
    lines.append(
        f"step: measured {step:.4f} s, roofline {bound:.4f} s ({step / bound:.2f}x); its tasks "
        f"{report['tasks_s']:.4f} s, the rest {step - report['tasks_s']:.4f} s"
    )
    if "torch_s" in report:
        lines.append(
            f"PyTorch peer: {report['torch_s']:.4f} s a step ({report['torch_s'] / step:.1f}x ours)"
        )
    else:
        lines.append("PyTorch peer: not installed (pip install torch==2.13.0)")
    return "\n".join(lines) + "\n"
