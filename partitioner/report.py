"""The partition report: a per-unit table and the `--json` object of docs/formats.md, and sweeps.

Each row is a unit (or `data`, or a helper's unit): its grid, the busiest rank's FLOPs summed over
its tasks, the bytes its tasks put on the wire, the memory per rank it accounts for (max and mean
over all ranks; `accounting.memory_by_unit` says which bytes belong to which row) and its predicted
seconds. The totals give the step: memory per rank is the max and mean of each rank's sum over
the rows, not a sum of the rows' maxima.
"""

from __future__ import annotations

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.micro_batches import schedule_of
from partitioner.cost import PlanCost
from partitioner.pipeline import stage_table
from partitioner.plan import Plan
from partitioner.search.stages import pipeline_label


def unit_rows(plan: Plan, cost: PlanCost) -> list[dict]:
    """One row per unit, in program order, plus the grid each unit's tasks ran on."""
    rows: dict[str, dict] = {}
    none = np.zeros(max(plan.nranks, 1), np.int64)
    grids = plan.unit_grids
    for task_cost in cost.tasks:
        row = rows.setdefault(
            task_cost.unit,
            {
                "layer": task_cost.unit,
                "grid": list(grids.get(task_cost.unit, ())) or "home",
                "grid_label": plan.grid_label(task_cost.unit)
                if task_cost.unit in grids
                else "home",
                # how many of the grid's last dims the unit's reducer sums over (`Σ` in the label)
                "summed_dims": plan.summed.get(task_cost.unit, 0),
                "flops_per_rank": 0.0,
                "bytes_sent": 0,
                "memory_per_rank_max": int(cost.memory_by_unit.get(task_cost.unit, none).max()),
                "memory_per_rank_mean": float(cost.memory_by_unit.get(task_cost.unit, none).mean()),
                "seconds": 0.0,
            },
        )
        row["flops_per_rank"] += task_cost.flops_max
        row["bytes_sent"] += task_cost.bytes_sent
        row["seconds"] += task_cost.seconds
    return list(rows.values())


def report_json(
    graph: TaskGraph,
    plan: Plan,
    cost: PlanCost,
    why: list[dict] | None,
    step: dict | None = None,
    memory: dict | None = None,
) -> dict:
    """The `--json` object; `step` overrides `predicted_step_seconds` with the simulated step
    (`runtime.step.model.StepModel.step_prediction`: `predicted_step_seconds`, `step_model`,
    `bulk_synchronous_seconds`), and `memory` the memory per rank with the runtime's
    (`runtime.step.rank_memory.memory_prediction`). Without it, memory per rank is what the rows
    count (every tensor and staging buffer held all step); with it, that count stays as
    `memory_held_*`."""
    held = list(cost.memory.values())
    micro_batches, schedule = schedule_of(graph)
    out = {
        "network": graph.network,
        "batch": graph.batch,
        "ranks": plan.nranks,
        "strategy": plan.strategy,
        "param_homes": _homes(graph, plan),
        "micro_batches": micro_batches,
        "schedule": schedule,
        "stages": stage_table(graph, plan.nranks),
        "predicted_step_seconds": cost.step_seconds,
        "bytes_sent_total": cost.bytes_sent,
        "memory_per_rank_max": cost.memory_max,
        "memory_per_rank_mean": sum(held) / len(held),
        "memory_held_per_rank_max": cost.memory_max,
        "memory_held_per_rank_mean": sum(held) / len(held),
        "feasible": cost.feasible,
        "machine": cost.machine.to_json(),
        "layers": unit_rows(plan, cost),
    }
    out |= step or {}
    out |= memory or {}
    if why is not None:
        out["why"] = why
    return out


def _homes(graph: TaskGraph, plan: Plan) -> str | list[str]:
    """`replicated`, `sharded` (every parameter), or the sharded parameters' names."""
    params = {n for n, t in graph.tensors.items() if t.kind == "param"}
    if not plan.sharded:
        return "replicated"
    return "sharded" if plan.sharded >= params else sorted(plan.sharded)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(report: dict) -> str:
    head = (
        f"{'layer':<30} {'grid':<16} {'GFLOP/rank':>11} {'sent':>10} {'held max':>10} "
        f"{'held mean':>10} {'seconds':>10}"
    )
    homes = report["param_homes"]
    homes = homes if isinstance(homes, str) else f"sharded: {', '.join(homes)}"
    title = (
        f"{report['network']}, batch {report['batch']}: {report['strategy']} on "
        f"{report['ranks']} ranks, {homes} homes"
    )
    lines = [title, head, "-" * len(head)]
    for row in report["layers"]:
        grid = row["grid_label"]
        lines.append(
            f"{row['layer']:<30} {grid:<16} {row['flops_per_rank'] / 1e9:>11.3f} "
            f"{_size(row['bytes_sent']):>10} {_size(row['memory_per_rank_max']):>10} "
            f"{_size(row['memory_per_rank_mean']):>10} {row['seconds']:>10.5f}"
        )
    lines.append("-" * len(head))
    flops = sum(r["flops_per_rank"] for r in report["layers"])
    lines.append(
        f"{'total':<30} {'':<16} {flops / 1e9:>11.3f} {_size(report['bytes_sent_total']):>10} "
        f"{_size(report['memory_held_per_rank_max']):>10} "
        f"{_size(report['memory_held_per_rank_mean']):>10} "
        f"{report['predicted_step_seconds']:>10.5f}"
    )
    if "memory_model" in report:
        lines.append(
            f"memory per rank {_size(report['memory_per_rank_max'])} at most "
            f"(rank {report['memory_peak_rank']}"
            + (f", at {report['memory_peak_at']}" if "memory_peak_at" in report else "")
            + "), "
            f"{_size(report['memory_per_rank_mean'])} on average: the runtime's buffers "
            f"({report['memory_model']}) and a process baseline of "
            f"{_size(report['process_baseline_bytes'])}"
        )
    if report.get("step_model") == "simulated":
        lines.append(
            f"step {report['predicted_step_seconds']:.5f} s, simulated (every rank's program on "
            f"the machine's links); {report['bulk_synchronous_seconds']:.5f} s as the rows' "
            "bulk-synchronous sum"
        )
    elif report.get("step_model") == "bulk-synchronous":
        lines.append(
            f"step {report['predicted_step_seconds']:.5f} s, the rows' bulk-synchronous sum: "
            "its ranks' programs are past the work a simulation builds (--simulate to "
            "simulate it anyway)"
        )
    for number, stage in enumerate(report.get("stages", [])):
        ranks = stage["ranks"]
        lines.append(
            f"stage {number} on ranks {ranks[0]}-{ranks[-1]}: {', '.join(stage['layers'])}"
        )
    if report.get("micro_batches", 1) > 1:
        bubble = (
            f"; waiting {report['bubble_fraction']:.0%} of the step (bubble of equal stages "
            f"{report['bubble_fraction_ideal']:.0%})"
            if "bubble_fraction" in report
            else ""
        )
        lines.append(f"{report['micro_batches']} micro-batches, {report['schedule']}{bubble}")
    for row in report.get("pipeline_search", []):
        if row["predicted_seconds"] is None:
            continue
        tried = pipeline_label(row["stages"], row["micro_batches"], row["cuts"], row["schedule"])
        summed = ", summed" if row.get("step_model") == "bulk-synchronous" else ""
        lines.append(f"  tried {tried}: {row['predicted_seconds']:.5f} s predicted{summed}")
    if not report["feasible"]:
        lines.append("INFEASIBLE: some rank needs more memory than it has")
    for item in report.get("why", []):
        sharded = f", {', '.join(item['sharded'])} sharded" if item.get("sharded") else ""
        lines.append(
            f"  {item['layer']}: {item['family']} {item['grid']}{sharded} predicts "
            f"{item['seconds']:.5f} s against {item['data_seconds']:.5f} s under data parallelism"
        )
    return "\n".join(lines) + "\n"


def sweep_table(rows: list[dict]) -> str:
    lines = [f"{'ranks':>6} {'step s':>10} {'mem/rank max':>14} {'sent':>10} strategy"]
    for row in rows:
        lines.append(
            f"{row['ranks']:>6} {row['predicted_step_seconds']:>10.5f} "
            f"{_size(row['memory_per_rank_max']):>14} {_size(row['bytes_sent_total']):>10} "
            f"{row['strategy']}"
        )
    return "\n".join(lines) + "\n"
