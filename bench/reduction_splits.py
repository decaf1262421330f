"""Benchmark: what reduction-dimension splits buy `auto`, by the cost model.

    python bench/reduction_splits.py [--json F]

1. The issue's MLP (`examples/megatron-mlp.json`: 4096 → 16384 → relu → 4096, batch 64) on 8
   ranks of a 100 GFLOP/s, 25 GB/s, 2 µs machine: model parallelism for both linear layers,
   Megatron's column-then-row plan (fc1 split over its outputs, fc2 over its inputs), and what
   `auto` picks; bytes a step sends and predicted step.
2. seed-lcn at batch 256 on 64 ranks of the 100 GFLOP/s, 12.5 GB/s, 2 µs, 16 GiB machine: data
   parallelism, `auto` without the reduction-split families (`row`, `row-spatial`,
   `batch4×row`) and with them; predicted steps and their ratio to data parallelism.

Every figure is the planner's and cost model's (no step is run); the measured counterparts are
`tests/partitioner/test_reduction_split.py` (bytes by hand, runs equal to one process) and
`legion-nn bench scaling --hosts 2 --strategies ...` (steps on the emulated cluster).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from legion_nn.networks import load_network
from legion_nn.spec import load_spec
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.search import families
from partitioner.search.auto import auto
from partitioner.strategy import Strategy, builtin, find_units

ROOT = Path(__file__).resolve().parent.parent
MLP_MACHINE = Machine(100, 25, 2, 16)
SEED_MACHINE = Machine(100, 12.5, 2, 16)


def column_then_row(graph, nranks: int) -> Strategy:
    grids = {}
    for unit in find_units(graph):
        grid = [1] * len(unit.extents)
        if unit.name in ("fc1", "act"):
            grid[1] = nranks
        elif unit.name == "fc2.linear2":
            grid[4] = nranks
        elif unit.extents[0] >= nranks:
            grid[0] = nranks
        grids[unit.name] = tuple(grid)
    return Strategy("column-then-row", grids)


def priced(graph, strategy: Strategy, nranks: int, machine: Machine) -> dict:
    cost = plan_cost(graph, build_plan(graph, strategy, nranks), machine)
    return {"bytes_sent": cost.bytes_sent, "step_seconds": cost.step_seconds}


def without_rows():
    return mock.patch.object(
        families, "FAMILIES", tuple(f for f in families.FAMILIES if "row" not in f)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="F")
    args = parser.parse_args(argv)
    out: dict = {}

    graph = load_spec(ROOT / "examples" / "megatron-mlp.json").lower(batch=64)
    chosen = auto(graph, 8, MLP_MACHINE)
    mlp = {
        "model/model": priced(graph, builtin(graph, "model", 8), 8, MLP_MACHINE),
        "column-then-row": priced(graph, column_then_row(graph, 8), 8, MLP_MACHINE),
        "auto": priced(graph, chosen.strategy, 8, MLP_MACHINE)
        | {"grids": {k: list(v) for k, v in chosen.strategy.unit_grids.items()}},
    }
    out["megatron-mlp, batch 64, 8 ranks"] = mlp
    print("megatron-mlp, batch 64, 8 ranks (100 GFLOP/s, 25 GB/s, 2 us)")
    for name, row in mlp.items():
        print(f"  {name:16s} {row['bytes_sent'] / 1e6:8.2f} MB/step  {row['step_seconds']:.5f} s")

    graph = load_network("seed-lcn").lower(batch=256)
    data = priced(graph, builtin(graph, "data", 64), 64, SEED_MACHINE)
    with without_rows():
        before = auto(graph, 64, SEED_MACHINE)
    after = auto(graph, 64, SEED_MACHINE)
    seed = {"data": data}
    for name, result in (("auto without row families", before), ("auto", after)):
        seed[name] = priced(graph, result.strategy, 64, SEED_MACHINE) | {
            "families": {c.unit: c.family for c in result.choices}
        }
    out["seed-lcn, batch 256, 64 ranks"] = seed
    print("seed-lcn, batch 256, 64 ranks (100 GFLOP/s, 12.5 GB/s, 2 us, 16 GiB)")
    for name, row in seed.items():
        ratio = data["step_seconds"] / row["step_seconds"]
        print(f"  {name:26s} {row['step_seconds']:.5f} s  {ratio:.2f}x data parallelism")
        if "families" in row:
            print(f"    {row['families']}")

    started = time.process_time()
    auto(load_network("vgg19").lower(batch=256), 1024, Machine())
    out["auto vgg19 1024 ranks cpu seconds"] = seconds = time.process_time() - started
    print(f"auto on vgg19 at 1024 ranks (batch 256): {seconds:.2f} s of CPU")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
