"""Benchmark: the linear kernels under two values of one of their block settings, side by side in
one process: b read in blocks of `TILED_COLUMNS` columns, 256 (the default) against 64 (the
block before), or c cut into `TILED_TASKS_PER_THREAD` blocks a thread, 8 (the default) against
16 (one thread's before the count was per thread: each row block reads all of b again), or the
input's gradient computed transposed at up to `INPUT_GRAD_TRANSPOSED_ROWS` rows (64) against
never (0).

    python bench/linear_blocks.py [--setting columns|tasks|transposed] [--rows 16,32,64,128,256]
        [--repeat 9]

Each line is one shape (rows, inputs, outputs) and pass (the forward x·wᵀ, the input's gradient
dy·w, the weight gradient's accumulation dyᵀ·x), the median of `--repeat` calls alternated
between the two values: the time with the first and the ratio second / first (below 1: the
default wins). The machine and the same run's SGEMM print first: the machine is shared. Run it
with `NUMBA_NUM_THREADS=1` for a rank on a core of its own (a pipeline stage's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import sgemm_gflops
from bench.machine_facts import describe, machine_facts
from runtime.kernels import linear

#: (inputs, outputs): an MLP's square layers, a narrowing and a widening one, a small one, and
#: the seed classifier's
SHAPES = ((2048, 2048), (4096, 1024), (1024, 4096), (512, 512), (46656, 3034))
#: --setting: (the module's name for it, (the value before, the default))
SETTINGS = {
    "columns": ("TILED_COLUMNS", (64, linear.TILED_COLUMNS)),
    "tasks": ("TILED_TASKS_PER_THREAD", (16, linear.TILED_TASKS_PER_THREAD)),
    "transposed": ("INPUT_GRAD_TRANSPOSED_ROWS", (0, linear.INPUT_GRAD_TRANSPOSED_ROWS)),
}


def passes(n: int, inputs: int, outputs: int):
    rng = np.random.default_rng(0)
    x = rng.random((n, inputs, 1, 1), np.float32)
    w = rng.random((outputs, inputs, 1, 1), np.float32)
    dy = rng.random((n, outputs, 1, 1), np.float32)
    dw = np.zeros_like(w)
    return {
        "forward": lambda: linear.linear_forward(x, w),
        "input grad": lambda: linear.linear_input_grad(dy, w, x.shape),
        "weight grad": lambda: linear.linear_weight_grad_accumulate(dy, x, dw),
    }


def side_by_side(call, setting: str, repeat: int) -> dict[int, float]:
    """Median seconds of `call` at each value of `setting`, the values alternated call by call."""
    name, values = SETTINGS[setting]
    times: dict[int, list[float]] = {value: [] for value in values}
    default = getattr(linear, name)
    try:
        for value in values:  # compiled and warm at both
            setattr(linear, name, value)
            call()
        for _ in range(repeat):
            for value in values:
                setattr(linear, name, value)
                start = time.perf_counter()
                call()
                times[value].append(time.perf_counter() - start)
    finally:
        setattr(linear, name, default)
    return {value: float(np.median(found)) for value, found in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="columns")
    parser.add_argument("--rows", default="16,32,64,128,256")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s")
    narrow, wide = SETTINGS[args.setting][1]
    print(
        f"{'rows':>5s} {'inputs':>6s} {'outputs':>7s} {'pass':12s} {narrow:>4d} {args.setting}"
        f"  {wide}/{narrow}"
    )
    for inputs, outputs in SHAPES:
        for n in (int(v) for v in args.rows.split(",")):
            if inputs * outputs > 1 << 24 and n > 64:
                continue  # the classifier at its own batch
            for name, call in passes(n, inputs, outputs).items():
                found = side_by_side(call, args.setting, args.repeat)
                print(
                    f"{n:5d} {inputs:6d} {outputs:7d} {name:12s} {found[narrow] * 1e3:7.2f} ms"
                    f"  {found[wide] / found[narrow]:6.2f}"
                )


if __name__ == "__main__":
    main()
