"""Benchmark: the default job's wall time on a cold and on a warm Numba cache.

    python bench/cold_start.py [--repeat 3] [--ranks 1,2] [--json F] [-- TRAIN ARGS...]

Each round runs `legion-nn train` (one process for 1 rank, `mpiexec -n R` otherwise) with
`NUMBA_CACHE_DIR` pointing at a new, empty directory (cold), then once more on the cache that
run left (warm). The figure is the wall time of the whole command, from exec to exit, so it
counts the interpreter's start, the imports, the compiling and the training; the median of the
rounds is reported beside each run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from legion_nn.atomic import write_text


def timed(command: list[str], cache: str) -> float:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def command(ranks: int, train_args: list[str]) -> list[str]:
    train = [sys.executable, "-m", "legion_nn.cli", "train", "--no-progress", *train_args]
    return train if ranks == 1 else ["mpiexec", "-n", str(ranks), *train]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--json")
    parser.add_argument("train_args", nargs="*")
    args = parser.parse_args()
    results = {}
    for ranks in (int(v) for v in args.ranks.split(",")):
        cold, warm = [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
                cold.append(timed(command(ranks, args.train_args), cache))
                warm.append(timed(command(ranks, args.train_args), cache))
        label = "1 process" if ranks == 1 else f"mpiexec -n {ranks}"
        print(
            f"{label}: cold {statistics.median(cold):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in cold)}), warm {statistics.median(warm):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in warm)})"
        )
        results[str(ranks)] = {"cold_s": cold, "warm_s": warm}
    if args.json:
        write_text(args.json, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
