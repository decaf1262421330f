"""Benchmark: what each compile unit (`runtime.compile_units.UNITS`) takes to compile on an empty
Numba cache, with plain loops (one thread) and parallel ones: the `Unit.seconds` that
`runtime.compile_ahead.assign` shares out and `runtime.kernel_threads` weighs.

    python bench/unit_compile_seconds.py [--units filter.untied,softmax] [--repeat 2]

Each measurement is a child process on an empty cache: it compiles a trivial function first
(what any first compile in a process pays: Numba's and LLVM's set-up), the GEMM (timed apart:
`compile_ahead.GEMM_SECONDS`) and the units of the unit's group listed before it (one process
compiles a group, and later units reuse what earlier ones compiled: `linear.step` calls
`linear`'s product), then the unit. The median of `--repeat` children is printed
beside the machine's facts; the table's numbers are this machine's, and the assignment only
needs them in proportion.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine_facts import describe, machine_facts

_CHILD = """
import json, sys, time
import numba, numpy as np
from runtime import compile_units
from runtime.kernels import microkernel
numba.njit(lambda x: x + 1)(1)
start = time.perf_counter()
microkernel.kernels(np.float32)
gemm = time.perf_counter() - start
compile_units.warm(sys.argv[2:], np.float32)
start = time.perf_counter()
compile_units.warm([sys.argv[1]], np.float32)
print(json.dumps({"gemm": gemm, "unit": time.perf_counter() - start}))
"""


def measure(unit: str, threads: int) -> dict[str, float]:
    """One child's seconds for the GEMM and for `unit`, on an empty cache, with `threads`,
    after the units of its group before it."""
    from runtime.compile_units import UNITS

    names = list(UNITS)
    before = [name for name in names[: names.index(unit)] if UNITS[name].group == UNITS[unit].group]
    with tempfile.TemporaryDirectory(prefix="legion-nn-units-") as cache:
        # `python -c` in the repository's root imports its packages from there
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "NUMBA_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, unit, *before],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from runtime.compile_units import UNITS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", default=",".join(UNITS))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    units = [u for u in args.units.split(",") if u]
    unknown = [u for u in units if u not in UNITS]
    if unknown or args.repeat < 1:
        print(
            f"unit_compile_seconds: unknown units {unknown}; choose from {', '.join(UNITS)}"
            if unknown
            else "unit_compile_seconds: --repeat is at least 1",
            file=sys.stderr,
        )
        return 2
    cores = max(os.cpu_count() or 1, 2)
    print(describe(machine_facts()))
    print(f"{'unit':24s} {'plain s':>8s} {'parallel s':>10s} {'table':>12s}")
    gemm = []
    for unit in units:
        row = []
        for threads in (1, cores):
            runs = [measure(unit, threads) for _ in range(args.repeat)]
            gemm += [r["gemm"] for r in runs]
            row.append(statistics.median(r["unit"] for r in runs))
        table = "({:.1f}, {:.1f})".format(*UNITS[unit].seconds)
        print(f"{unit:24s} {row[0]:8.2f} {row[1]:10.2f} {table:>12s}", flush=True)
    print(f"GEMM (float32): median {statistics.median(gemm):.2f} s over {len(gemm)} children")
    return 0


if __name__ == "__main__":
    sys.exit(main())
