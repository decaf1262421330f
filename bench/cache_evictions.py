"""Benchmark: a plan's pieces profiled after each way of taking their operands out of the caches.

    python bench/cache_evictions.py [--network seed-lcn-small] [--batch 64] [--ranks 2]
                                    [--strategies data,model,spatial] [--rounds 3]

`bench.cache_eviction` flushes a piece's operands' own lines where the CPU can, and otherwise
overwrites twice the last-level cache; `bench machine`'s pieces table and `compute_factor` were
fitted and checked with the second. This profiles the one-rank data plan's pieces and those of
each strategy's plan on `--ranks` ranks (one Numba thread, the optimizer `bench machine` fits
with) under each eviction in turn, `--rounds` times over so that a slow stretch of the machine
falls on both, and prints per eviction the seconds each spent evicting and profiling, and the
pieces' times against the write's: their sum, and the median and range of piece by piece. Warm
caches ("none") print beside them for scale. The machine's facts print first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cache_eviction
from bench.jobs import OPTIMIZER
from bench.machine_facts import describe, machine_facts
from bench.task_profile import profile_as_run, sample_step
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import builtin


def profile_rounds(graph, plans, evictions, rounds: int) -> tuple[dict, dict]:
    """({eviction: {piece key: median seconds over rounds}}, {eviction: seconds spent})."""
    sample = sample_step(graph)
    times: dict[str, dict] = {e: {} for e in evictions}
    spent = dict.fromkeys(evictions, 0.0)
    for _ in range(rounds):
        for eviction in evictions:
            cache: dict = {}
            start = time.perf_counter()
            with cache_eviction.evicting(eviction):
                for plan in plans:
                    profile_as_run(graph, plan, 1, sample, cache)
            spent[eviction] += time.perf_counter() - start
            for key, seconds in cache.items():
                times[eviction].setdefault(key, []).append(seconds)
    medians = {e: {k: statistics.median(v) for k, v in t.items()} for e, t in times.items()}
    return medians, spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", default="seed-lcn-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategies", default="data,model,spatial")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(describe(machine_facts()))
    evictions = cache_eviction.available_evictions()
    graph = load_network(args.network).lower(batch=args.batch, optimizer=OPTIMIZER)
    plans = [build_plan(graph, builtin(graph, "data", 1), 1)] + [
        build_plan(graph, builtin(graph, s, args.ranks), args.ranks)
        for s in args.strategies.split(",")
    ]
    medians, spent = profile_rounds(graph, plans, evictions, args.rounds)
    keys = list(medians["write"])
    print(f"{args.network} batch {args.batch}: {len(keys)} pieces, {args.rounds} round(s)")
    print(f"{'eviction':>8} {'s spent':>8} {'sum ms':>8} {'sum/write':>9} "
          f"{'median':>7} {'range of piece/write':>21}")  # fmt: skip
    written = sum(medians["write"][k] for k in keys)
    for eviction in evictions:
        total = sum(medians[eviction][k] for k in keys)
        ratios = sorted(medians[eviction][k] / medians["write"][k] for k in keys)
        print(f"{eviction:>8} {spent[eviction]:>8.1f} {total * 1e3:>8.2f} {total / written:>9.3f} "
              f"{statistics.median(ratios):>7.3f} {ratios[0]:>10.3f}-{ratios[-1]:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
