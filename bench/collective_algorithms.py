"""Benchmark tool: a plan's simulated step with its all-reduces run by each algorithm in turn
(the ring, halving-doubling, the binomial tree) and by the one the machine's prices choose
(`collective_prices.allreduce_algorithm`), beside the step the cost model sums.

    python bench/collective_algorithms.py NETWORK:RANKS:STRATEGY[:BATCH] ... [--machine F]

`collectives.schedule` runs whichever algorithm the closed-form prices least; the step
simulator, which queues messages on each host's links and posts rounds where the runtime does,
is what says whether that choice holds beside everything else a step moves. Each case's plan is
built once, its programs built again for each algorithm (their collectives' hops differ), and
the row prints each simulated step as a ratio of the chosen one's. `--machine` is a machine
file (default: the built-in machine), e.g. one `legion-nn bench machine` measured on a cluster.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from legion_nn.networks import load_network
from partitioner import collectives
from partitioner.cost import bulk_seconds
from partitioner.machine import Machine
from partitioner.machine_file import load_machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.step.model import StepModel

ALGORITHMS = ("ring", "halving", "tree")


@contextmanager
def all_reduces_by(algorithm: str | None):
    """Within the block, every all-reduce of more than two ranks runs by `algorithm` (None: as
    the machine's prices choose)."""
    chosen = collectives.allreduce_algorithm

    def forced(p: int, n: int, machine: Machine) -> tuple[str, float]:
        name, seconds = chosen(p, n, machine)
        return (algorithm, seconds) if algorithm and p > 2 else (name, seconds)

    collectives.allreduce_algorithm = forced
    try:
        yield
    finally:
        collectives.allreduce_algorithm = chosen


def compare(network: str, nranks: int, strategy: str, batch: int, machine: Machine) -> dict:
    """Per algorithm (and "chosen"), the simulated step of the case's plan; "summed", the cost
    model's bulk-synchronous step of it."""
    graph = load_network(network).lower(batch=batch)
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    out = {"summed": bulk_seconds(graph, plan, machine)}
    for algorithm in (None, *ALGORITHMS):
        with all_reduces_by(algorithm):
            simulated = StepModel(machine).simulated(graph, plan)
        out[algorithm or "chosen"] = None if simulated is None else simulated.seconds
    return out


#: how a case is written on the command line (the batch 256 where left out)
CASE_FORM = "NETWORK:RANKS:STRATEGY[:BATCH]"


def plan_case(text: str) -> tuple[str, int, str, int] | None:
    """(network, ranks, strategy, batch) of a case written as `CASE_FORM`, else None."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit():
        return None
    if len(parts) == 4 and not parts[3].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else 256


def cases_and_machine(
    tool: str, description: str, argv: list[str] | None
) -> tuple[list[tuple[str, tuple[str, int, str, int]]], Machine] | None:
    """A plan tool's command line: its cases, each as written and parsed (`plan_case`), and
    its machine (`--machine F`, default the built-in one); None, after one line naming it,
    where a case is not in `CASE_FORM` (the tool exits 2)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("cases", nargs="+", help=f"{CASE_FORM} (batch 256)")
    parser.add_argument("--machine", default=None, help="a machine file (default: built-in)")
    args = parser.parse_args(argv)
    cases = []
    for text in args.cases:
        parsed = plan_case(text)
        if parsed is None:
            print(f"{tool}: {text!r} is not {CASE_FORM}", file=sys.stderr)
            return None
        cases.append((text, parsed))
    return cases, load_machine(args.machine)


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0]
    command_line = cases_and_machine("collective_algorithms", description, argv)
    if command_line is None:
        return 2
    cases, machine = command_line
    print(f"{'case':34s} {'chosen':>10s} " + " ".join(f"{a:>8s}" for a in ALGORITHMS) + "  summed")
    for case, parsed in cases:
        found = compare(*parsed, machine)
        chosen = found["chosen"]
        ratios = " ".join(
            f"{found[a] / chosen:7.3f}x" if found[a] and chosen else f"{'-':>8s}"
            for a in ALGORITHMS
        )
        step = f"{chosen:.5f}s" if chosen is not None else "summed"
        print(f"{case:34s} {step:>10s} {ratios}  {found['summed']:.5f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
