"""Benchmark: the default job's wall time on a cold and on a warm Numba cache.

    python bench/cold_start.py [--repeat 3] [--ranks 1,2] [--threads 1,2] [--json F]
                               [-- TRAIN ARGS...]

Each round runs `legion-nn train` (one process for 1 rank, `mpiexec -n R` otherwise) with
`NUMBA_CACHE_DIR` pointing at a new, empty directory (cold), then once more on the cache that
run left (warm). The figure is the wall time of the whole command, from exec to exit, so it
counts the interpreter's start, the imports, the compiling and the training; the median of the
rounds is reported beside each run's own, and, for the warm runs, the ratio of the wall time to
the training time the job reports (`done in T s`): what start-up and exit add to a job; and the
ratio of the medians, cold over warm (the issue's goal: at most 2).

`--threads` runs the one-process job once per Numba thread count given (`NUMBA_NUM_THREADS`):
with one thread it calls, and compiles, its kernels' plain loops, with more their parallel ones
(`runtime.kernels.threaded`), so the two rows show what the parallel loops cost a cold start
and what they give the warm run. A rank under `mpiexec` sets its own count from its host's cores
(`runtime.launch.share_cores`), so `--threads` leaves those runs as they are.

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


def timed(
    command: list[str], cache: str, bytecode: bool, threads: int | None = None
) -> tuple[float, float]:
    """The command's wall time, and the training time it reports; `threads`: the Numba
    threads of a one-process run (None: as the machine's cores give)."""
    env = dict(command_environment(bytecode), NUMBA_CACHE_DIR=cache)
    if threads is not None:
        env["NUMBA_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    reported = re.search(r"^done in ([0-9.]+) s", done.stdout, re.MULTILINE)
    return wall, float(reported.group(1)) if reported else float("nan")


def command(ranks: int, train_args: list[str]) -> list[str]:
    train = [sys.executable, "-m", "cli", "train", "--no-progress", *train_args]
    return train if ranks == 1 else ["mpiexec", "-n", str(ranks), *train]


def variants(ranks: str, threads: str | None) -> list[tuple[int, int | None, str]]:
    """(ranks, Numba threads or None, label) of each row: one per thread count for one
    process, one per rank count under `mpiexec`; ValueError names a count that is not a
    positive integer."""
    counts = [_positive(v, "--ranks") for v in ranks.split(",")]
    per_process = [None] if not threads else [_positive(v, "--threads") for v in threads.split(",")]
    rows = []
    for count in counts:
        if count > 1:
            rows.append((count, None, f"mpiexec -n {count}"))
            continue
        for t in per_process:
            suffix = "" if t is None else f", {t} thread{'s' if t > 1 else ''}"
            rows.append((1, t, f"1 process{suffix}"))
    return rows


def _positive(text: str, flag: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{flag}: {text!r} is not a positive integer")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument(
        "--threads",
        help="Numba thread counts of the one-process runs, e.g. 1,2 (default: the cores')",
    )
    parser.add_argument("--json")
    parser.add_argument(
        "--no-bytecode-cache",
        dest="bytecode",
        action="store_false",
        help="run every child with PYTHONDONTWRITEBYTECODE=1 (no module's bytecode is cached)",
    )
    parser.add_argument("train_args", nargs="*")
    args = parser.parse_args()
    try:
        rows = variants(args.ranks, args.threads)
    except ValueError as exc:
        parser.exit(2, f"cold_start: {exc}\n")
    results: dict = {"machine": machine_facts()}
    results["bytecode_cache"] = args.bytecode
    print(describe(results["machine"]))
    print(
        "bytecode cache: "
        + ("on, as Python's default" if args.bytecode else "off (PYTHONDONTWRITEBYTECODE=1)")
    )
    for ranks, threads, label in rows:
        cold, warm, ratios = [], [], []
        job = command(ranks, args.train_args)
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
                cold.append(timed(job, cache, args.bytecode, threads)[0])
                wall, reported = timed(job, cache, args.bytecode, threads)
                warm.append(wall)
                ratios.append(wall / reported)
        over = statistics.median(cold) / statistics.median(warm)
        print(
            f"{label}: cold {statistics.median(cold):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in cold)}), warm {statistics.median(warm):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in warm)}), cold / warm {over:.2f}, warm wall / "
            f"reported training {statistics.median(ratios):.2f} "
            f"({', '.join(f'{r:.2f}' for r in ratios)})"
        )
        key = str(ranks) if threads is None else f"{ranks}x{threads}"
        results[key] = {
            "label": label,
            "cold_s": cold,
            "warm_s": warm,
            "cold_over_warm": over,
            "warm_wall_over_reported": ratios,
        }
    if args.json:
        write_text(args.json, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
