"""Benchmark: the default job's wall time on a cold and on a warm Numba cache.

    python bench/cold_start.py [--repeat 3] [--ranks 1,2] [--json F] [-- TRAIN ARGS...]

Each round runs `legion-nn train` (one process for 1 rank, `mpiexec -n R` otherwise) with
`NUMBA_CACHE_DIR` pointing at a new, empty directory (cold), then once more on the cache that
run left (warm). The figure is the wall time of the whole command, from exec to exit, so it
counts the interpreter's start, the imports, the compiling and the training; the median of the
rounds is reported beside each run's own, and, for the warm runs, the ratio of the wall time to
the training time the job reports (`done in T s`): what start-up and exit add to a job.

A user's second run of the job finds Python's bytecode cache, so the children run with it
(`bench.jobs.command_environment`), and the cold runs miss only Numba's cache.
`--no-bytecode-cache` sets `PYTHONDONTWRITEBYTECODE` for every child: each run then compiles
every module it imports from source, as in an environment that sets it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.jobs import command_environment
from bench.machine_facts import describe, machine_facts
from legion_nn.atomic import write_text


def timed(command: list[str], cache: str, bytecode: bool) -> tuple[float, float]:
    """The command's wall time, and the training time it reports."""
    env = dict(command_environment(bytecode), NUMBA_CACHE_DIR=cache)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    reported = re.search(r"^done in ([0-9.]+) s", done.stdout, re.MULTILINE)
    return wall, float(reported.group(1)) if reported else float("nan")


def command(ranks: int, train_args: list[str]) -> list[str]:
    train = [sys.executable, "-m", "cli", "train", "--no-progress", *train_args]
    return train if ranks == 1 else ["mpiexec", "-n", str(ranks), *train]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--json")
    parser.add_argument(
        "--no-bytecode-cache",
        dest="bytecode",
        action="store_false",
        help="run every child with PYTHONDONTWRITEBYTECODE=1 (no module's bytecode is cached)",
    )
    parser.add_argument("train_args", nargs="*")
    args = parser.parse_args()
    results: dict = {"machine": machine_facts()}
    results["bytecode_cache"] = args.bytecode
    print(describe(results["machine"]))
    print(
        "bytecode cache: "
        + ("on, as Python's default" if args.bytecode else "off (PYTHONDONTWRITEBYTECODE=1)")
    )
    for ranks in (int(v) for v in args.ranks.split(",")):
        cold, warm, ratios = [], [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
                cold.append(timed(command(ranks, args.train_args), cache, args.bytecode)[0])
                wall, reported = timed(command(ranks, args.train_args), cache, args.bytecode)
                warm.append(wall)
                ratios.append(wall / reported)
        label = "1 process" if ranks == 1 else f"mpiexec -n {ranks}"
        print(
            f"{label}: cold {statistics.median(cold):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in cold)}), warm {statistics.median(warm):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in warm)}), warm wall / reported training "
            f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
        )
        results[str(ranks)] = {"cold_s": cold, "warm_s": warm, "warm_wall_over_reported": ratios}
    if args.json:
        write_text(args.json, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
