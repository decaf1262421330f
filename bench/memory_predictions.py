"""Benchmark: each rank's memory as `partition` predicts it, against what `train` holds.

    python bench/memory_predictions.py [--cases seed-lcn-small:8,seed-lcn:16] [--ranks 1,2,4]
        [--strategies data,model,spatial] [--homes replicated,sharded] [--optimizer adam]
        [--machine F] [--json F] [--no-run]

For every case (network at its batch, ranks, strategy, parameter homes) the prediction is
`runtime.step.rank_memory.predict` of the plan `partition` would make (Adam, float32, as `train` runs
by default): each rank's buffers, placed as the runtime places them, and the process baseline of
the machine file (the default's stated 200 MiB without `--machine`). The measurement is
`mpiexec -n R legion-nn train --steps 2 --log-json` of the same job: each rank's
`buffer_peak_bytes` (the runtime's own count of its resident tensors and arena) and
`rss_peak_bytes` (the kernel's high-water mark of the process's resident set, `ru_maxrss`). Each
figure is the worst rank's ratio of measured to predicted. Beside them, the fullest rank's placed
buffers over `auto`'s count of them (`accounting.memory_per_rank`, every tensor and staging
buffer held all step), which must stay at most 1 for what `auto` counts as fitting to fit as
placed; `--no-run` prints that alone, with no job run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.jobs import failure_line
from legion_nn.atomic import write_text
from legion_nn.networks import load_network
from partitioner.accounting import memory_per_rank
from partitioner.machine_file import load_machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, with_homes
from runtime.step.rank_memory import predict

STEPS = 2


def measure(network: str, batch: int, ranks: int, strategy: str, homes: str, tmp: Path) -> dict:
    """Per rank, the most `buffer_peak_bytes` and `rss_peak_bytes` of any step of the job."""
    log = tmp / f"{network}-{ranks}-{strategy}-{homes}.jsonl"
    command = [
        "mpiexec", "-n", str(ranks), sys.executable, "-m", "cli", "train", network,
        "--data", "synthetic", "--batch", str(batch), "--steps", str(STEPS),
        "--strategy", strategy, "--param-homes", homes, "--no-progress", "--no-evaluation",
        "--log-json", str(log),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        return {"failed": failure_line(result.stderr)}
    out: dict[int, dict] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "step" in record:
            mine = out.setdefault(record["rank"], {"buffers": 0, "rss": 0})
            mine["buffers"] = max(mine["buffers"], record["buffer_peak_bytes"])
            mine["rss"] = max(mine["rss"], record["rss_peak_bytes"])
    return out


def case_row(
    network: str, batch: int, ranks: int, strategy: str, homes: str, machine, args, tmp
) -> dict:
    graph = load_network(network).lower(batch=batch, optimizer=args.optimizer)
    plan = build_plan(graph, with_homes(graph, builtin(graph, strategy, ranks), homes), ranks)
    predicted = predict(graph, plan, machine)
    counted = memory_per_rank(graph, plan)
    row = {"network": network, "batch": batch, "ranks": ranks, "strategy": strategy}
    row |= {"homes": homes, "predicted_peak_max": max(m.peak for m in predicted.values())}
    row["placed_over_counted"] = max(
        m.buffer_bytes / max(counted[r], 1) for r, m in predicted.items()
    )
    if args.no_run:
        return row
    measured = measure(network, batch, ranks, strategy, homes, tmp)
    if "failed" in measured:
        return row | measured
    buffers = [measured[r]["buffers"] / predicted[r].buffer_bytes for r in predicted]
    rss = [measured[r]["rss"] / predicted[r].peak for r in predicted]
    return row | {
        "measured_rss_max": max(m["rss"] for m in measured.values()),
        "buffers_ratio": max(buffers, key=lambda v: abs(v - 1)),
        "rss_ratio": max(rss, key=lambda v: abs(v - 1)),
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'network':16s} {'batch':>5s} {'ranks':>5s} {'strategy':8s} {'homes':10s} "
        f"{'predicted':>10s} {'placed/counted':>14s} {'RSS':>10s} {'buffers':>8s} {'RSS':>7s}"
    )
    lines = [head]
    for row in rows:
        head = (
            f"{row['network']:16s} {row['batch']:5d} {row['ranks']:5d} {row['strategy']:8s} "
            f"{row['homes']:10s} {row['predicted_peak_max'] / 2**30:9.3f}G "
            f"{row['placed_over_counted']:14.3f}"
        )
        if "failed" in row:
            lines.append(f"{head} failed: {row['failed']}")
            continue
        if "measured_rss_max" not in row:  # --no-run
            lines.append(head)
            continue
        lines.append(
            f"{head} {row['measured_rss_max'] / 2**30:9.3f}G {row['buffers_ratio']:8.4f} "
            f"{row['rss_ratio']:7.3f}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="seed-lcn-small:8,seed-lcn:16")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--strategies", default="data,model,spatial")
    parser.add_argument("--homes", default="replicated,sharded")
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    parser.add_argument("--machine", metavar="F", help="machine JSON (its process baseline)")
    parser.add_argument("--no-run", action="store_true", help="predict and count; run no job")
    parser.add_argument("--json", metavar="F")
    args = parser.parse_args()
    machine = load_machine(args.machine)
    rows = []
    with tempfile.TemporaryDirectory(prefix="legion-nn-memory-") as tmp:
        for case in args.cases.split(","):
            network, batch = case.split(":")
            for ranks in map(int, args.ranks.split(",")):
                for strategy in args.strategies.split(","):
                    for homes in args.homes.split(","):
                        row = case_row(
                            network, int(batch), ranks, strategy, homes, machine, args, Path(tmp)
                        )
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
    print(table(rows), end="")
    if args.json:
        write_text(args.json, json.dumps({"results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
