"""Benchmark: how much longer a plan's kernels take in a traced training step than profiled,
on one rank and on each rank of an R-rank plan on this host.

    python bench/step_factor.py [--network seed-lcn-small] [--batch 64] [--ranks 2]
                                [--strategies data,model,spatial] [--steps 400]
                                [--evictions write,flush,none]

The cost model prices a rank's kernels as its profiled pieces times one factor fitted to a
one-rank step (`Machine.compute_factor`, `bench.calibration`). That holds on more ranks only if
the step's time over the profile does not depend on the pieces' sizes. Per strategy, a one-rank
training and an R-rank one (`mpiexec -n R`, one Numba thread a rank), each traced; then each
rank's pieces profiled as its program runs them (`task_profile.profile_ranks`), after each of
`--evictions` in turn (`bench.cache_eviction`: "write", the last-level cache overwritten twice;
"flush", the piece's operands' lines flushed; "none", the caches the piece's earlier runs
left). Printed per rank: the sum of its tasks' median times in the traced steps (the per-task
overhead included), and per eviction the sum of its profiled pieces and the step's ratio to
it, beside the one-rank step's. Where an eviction's ratios agree, a factor fitted on one rank
prices R: their spread (the largest over the smallest) prints last. The machine's facts print
first: the ratios move with the caches and with the machine's other tenants.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cache_eviction, task_profile
from bench.calibration import task_medians
from bench.cluster_scaling import split_homes
from bench.jobs import OPTIMIZER, run_job
from bench.machine_facts import describe, machine_facts
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import builtin, with_homes


def step_over_profile(trace: dict, rank: int, profiled: dict[str, float]) -> tuple[float, float]:
    """(seconds of `rank`'s tasks in the traced step, seconds of their profiled pieces)."""
    spent = task_medians(trace, rank)
    return sum(spent.values()), sum(profiled.get(name, 0.0) for name in spent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", default="seed-lcn-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--strategies", default="data,model,spatial", help="built-ins, each perhaps +sharded"
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--evictions",
        default=",".join(cache_eviction.available_evictions()),
        help="how each profiled run's operands leave the caches, each in turn "
        "(flush, write, none; default: %(default)s)",
    )
    args = parser.parse_args()
    evictions = args.evictions.split(",")
    try:
        for eviction in evictions:
            cache_eviction.check_eviction(eviction)
    except LegionNNError as exc:
        parser.error(str(exc))
    print(describe(machine_facts()))
    graph = load_network(args.network).lower(batch=args.batch, optimizer=OPTIMIZER)
    sample = task_profile.sample_step(graph)
    caches: dict[str, dict] = {e: {} for e in evictions}
    ratios: dict[str, list[float]] = {e: [] for e in evictions}
    one_plan = build_plan(graph, builtin(graph, "data", 1), 1)
    print(f"{args.network} batch {args.batch}; per eviction, the profile's ms and step/profile")
    print(f"{'plan':>10} {'rank':>4} {'step ms':>8}"
          + "".join(f" {e + ' ms':>9} {'ratio':>6}" for e in evictions))  # fmt: skip
    for strategy in args.strategies.split(","):
        name, homes = split_homes(strategy)
        with tempfile.TemporaryDirectory(prefix="legion-nn-step-factor-") as tmp:
            jobs = []
            for ranks in (1, args.ranks):
                work = Path(tmp) / f"r{ranks}"
                work.mkdir()
                many = ranks > 1
                extra = ["--param-homes", homes] if homes and many else []
                jobs.append(run_job(args.network, args.batch, ranks, name if many else "data",
                                    args.steps, work, threads=1, traced=True, extra=extra))  # fmt: skip
        chosen = builtin(graph, name, args.ranks)
        if homes:
            chosen = with_homes(graph, chosen, homes)
        plan = build_plan(graph, chosen, args.ranks)
        profiles = {}
        for eviction in evictions:
            with cache_eviction.evicting(eviction):
                one = task_profile.profile_ranks(graph, one_plan, 1, sample, caches[eviction])
                many = task_profile.profile_ranks(graph, plan, 1, sample, caches[eviction])
            profiles[eviction] = {("1 rank", 0): one[0]} | {
                (strategy, rank): many[rank] for rank in sorted(many)
            }
        for label, rank in profiles[evictions[0]]:
            trace = jobs[0 if label == "1 rank" else 1].trace
            cells = []
            for eviction in evictions:
                step, profile = step_over_profile(trace, rank, profiles[eviction][(label, rank)])
                ratios[eviction].append(step / max(profile, 1e-12))
                cells.append(f" {profile * 1e3:9.2f} {ratios[eviction][-1]:6.3f}")
            print(f"{label:>10} {rank:>4} {step * 1e3:8.2f}{''.join(cells)}")
    print("spread of the ratios (largest over smallest): " + ", ".join(
        f"{e} {max(r) / min(r):.2f}" for e, r in ratios.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
