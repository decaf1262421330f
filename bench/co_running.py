"""Benchmark: a kernel's time on its core alone against its time while every other core runs the
same kernel, the slowdown a rank's pieces take when the ranks sharing its memory compute too.

    python bench/co_running.py [--rows 16,32,64,128] [--width 2048] [--seconds 2]

`bench machine` times a plan's pieces on one rank with the others idle, and a step's pieces run
while the other ranks compute theirs. Where the ranks share a memory system (ranks on one host,
and the emulated cluster's hosts, which are namespaces of one machine), a piece that streams
its operands from memory rather than computing on them from cache gets a share of the memory's
bandwidth. For each pass of a linear layer (the forward x·wᵀ, the input gradient dy·w, the
weight gradient dyᵀ·x) at each row count, one process per core, each pinned to its core with
one Numba thread: the median time of the pass on core 0 while the other processes wait, then
with all of them running it at once, and the ratio. The machine's facts and the same run's
SGEMM print first: the machine is shared.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PASSES = ("forward", "input grad", "weight grad")


def _timed(call, seconds: float) -> float:
    """The median seconds of `call`, run for `seconds`."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _worker(core: int, timed: bool, cases, seconds: float, barrier, results) -> None:
    """One process on `core`; the `timed` one reports its times of each case."""
    os.sched_setaffinity(0, {core})
    import numpy as np

    from runtime.kernels import linear

    rng = np.random.default_rng(core)
    for rows, width, name in cases:
        x = rng.random((rows, width, 1, 1), np.float32)
        w = rng.random((width, width, 1, 1), np.float32)
        dy = rng.random((rows, width, 1, 1), np.float32)
        dw = np.zeros_like(w)
        call = {
            "forward": partial(linear.linear_forward, x, w),
            "input grad": partial(linear.linear_input_grad, dy, w, x.shape),
            "weight grad": partial(linear.linear_weight_grad_accumulate, dy, x, dw),
        }[name]
        call()  # compiled and warm
        barrier.wait()
        if timed:
            alone = _timed(call, seconds)
        barrier.wait()
        together = _timed(call, seconds)
        barrier.wait()
        if timed:
            results.put((rows, width, name, alone, together))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,32,64,128")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.width < 1 or args.seconds <= 0:
        print("co_running: --rows, --width and --seconds must be positive", file=sys.stderr)
        return 2
    os.environ["NUMBA_NUM_THREADS"] = "1"  # before any import of Numba, here or in a worker
    from bench.kernels import sgemm_gflops
    from bench.machine_facts import describe, machine_facts

    cores = sorted(os.sched_getaffinity(0))
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s; {len(cores)} cores, a process on each")
    cases = [(n, args.width, name) for n in rows for name in PASSES]
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(len(cores)), spawn.Queue()
    workers = [
        spawn.Process(target=_worker, args=(core, i == 0, cases, args.seconds, barrier, results))
        for i, core in enumerate(cores)
    ]
    for worker in workers:
        worker.start()
    print(f"{'rows':>5s} {'width':>6s} {'pass':12s} {'alone':>9s} {'together':>9s}  ratio")
    try:
        for _ in cases:
            n, width, name, alone, together = results.get()
            print(
                f"{n:5d} {width:6d} {name:12s} {alone * 1e3:7.2f}ms {together * 1e3:7.2f}ms"
                f"  {together / alone:5.2f}"
            )
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
