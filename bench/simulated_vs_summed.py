"""Benchmark tool: a plan's simulated step beside the step the cost model sums, for plans of
any size (the simulation budget lifted), and how long the simulation took.

    python bench/simulated_vs_summed.py NETWORK:RANKS:STRATEGY[:BATCH] ... [--machine F]

`partition` reports the simulated step wherever the programs it builds fit
`prediction.SIMULATE_MAX_WORK`, and the bulk-synchronous sum beyond it; `auto` compares sums
where `prediction.objective_simulates` says so. Where the two part, the sum ranks plans by
a step the runtime does not take. This simulates any plan, every rank's program built, by the
compiled loop, and prints each case's sum, its simulated step, their ratio and the seconds the
simulation took (building the programs included). STRATEGY is a built-in or `auto`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.collective_algorithms import cases_and_machine
from legion_nn.networks import load_network
from partitioner.cost import bulk_seconds
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.strategy import builtin
from runtime.step.prediction import predict_step, simulate_compiled


def compare(network: str, nranks: int, strategy: str, batch: int, machine: Machine) -> dict:
    """The case's plan's summed step, simulated step and seconds simulating it."""
    graph = load_network(network).lower(batch=batch)
    if strategy == "auto":
        chosen, _ = resolve_strategy(graph, "auto", nranks, machine, 10.0)
    else:
        chosen = builtin(graph, strategy, nranks)
    plan = build_plan(graph, chosen, nranks)
    summed = bulk_seconds(graph, plan, machine)
    began = time.perf_counter()
    step = predict_step(graph, plan, machine, simulate=simulate_compiled)
    took = time.perf_counter() - began
    return {"summed": summed, "simulated": step.seconds, "seconds": took}


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0]
    command_line = cases_and_machine("simulated_vs_summed", description, argv)
    if command_line is None:
        return 2
    cases, machine = command_line
    print(f"{'case':30s} {'summed':>10s} {'simulated':>10s} {'ratio':>7s} {'took':>8s}")
    for case, parsed in cases:
        found = compare(*parsed, machine)
        ratio = found["simulated"] / found["summed"]
        print(
            f"{case:30s} {found['summed']:9.4f}s {found['simulated']:9.4f}s {ratio:6.3f}x"
            f" {found['seconds']:7.1f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
