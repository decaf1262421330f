"""Benchmark: seconds to plan a training step, per network, strategy and rank count.

    python bench/planning.py [--networks seed-lcn,vgg19] [--strategies data,model,spatial,auto]
                             [--ranks 64,1024] [--batch 256] [--repeat 3] [--verify]

"planning" is `build_plan` + `plan_cost` on the default machine; for `auto` it is the search
(`partitioner/search/auto.py`: unit transitions priced by `partitioner/search/transitions.py`, lazily against
lower bounds, then a DP) plus the final plan, which reuses the pieces the search computed for the
grids it chose, as `legion-nn partition --strategy auto` does. `--verify` adds a column timing
`verify_plan`, the brute-force check of the plan's invariants. Each cell is the best of
`--repeat` runs, each run from scratch (nothing is kept between them); on a shared machine the
CPU column is the steadier one. The issue's goal: seed-lcn (batch 256) and vgg19 on 1024 ranks
in under 2 s for each of data, model, spatial and auto.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.search.auto import auto
from partitioner.strategy import builtin
from partitioner.verify_plan import verify_plan


def best_of(fn, repeat: int) -> tuple[float, float, object]:
    """(best wall seconds, best CPU seconds of this process, the result) over `repeat` runs.

    On a shared machine the CPU time is the steadier figure: the wall time also counts the
    moments a neighbour had the core."""
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu, result


def plan_once(graph, strategy: str, nranks: int, machine: Machine, time_limit: float):
    if strategy == "auto":
        chosen = auto(graph, nranks, machine, time_limit).strategy
    else:
        chosen = builtin(graph, strategy, nranks)
    plan = build_plan(graph, chosen, nranks)
    return plan, plan_cost(graph, plan, machine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="seed-lcn,vgg19")
    parser.add_argument("--strategies", default="data,model,spatial,auto")
    parser.add_argument("--ranks", default="64,1024")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=30.0, help="auto's limit (s)")
    parser.add_argument("--verify", action="store_true", help="also time verify_plan")
    args = parser.parse_args()
    machine = Machine()
    head = (
        f"{'network':<12}{'strategy':<10}{'ranks':>6}{'planning s':>12}{'cpu s':>8}{'step s':>10}"
    )
    print(head + (f"{'verify s':>10}" if args.verify else ""))
    for network in args.networks.split(","):
        graph = load_network(network).lower(batch=args.batch)
        for strategy in args.strategies.split(","):
            for nranks in (int(r) for r in args.ranks.split(",")):
                run = partial(plan_once, graph, strategy, nranks, machine, args.time_limit)
                seconds, cpu, (plan, cost) = best_of(run, args.repeat)
                line = (
                    f"{network:<12}{strategy:<10}{nranks:>6}{seconds:>12.2f}{cpu:>8.2f}"
                    f"{cost.step_seconds:>10.4f}"
                )
                if args.verify:
                    checked, _, _ = best_of(partial(verify_plan, graph, plan), 1)
                    line += f"{checked:>10.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
