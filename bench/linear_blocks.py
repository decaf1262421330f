"""Benchmark: the linear kernels with b read in blocks of `TILED_COLUMNS` columns, 256 (the
default) against 64 (the block before), side by side in one process.

    python bench/linear_blocks.py [--rows 16,32,64,128,256] [--repeat 9]

Each line is one shape (rows, inputs, outputs) and pass (the forward x·wᵀ, the input's gradient
dy·w, the weight gradient's accumulation dyᵀ·x), the median of `--repeat` calls alternated
between the two block widths: the time with 64 columns and the ratio 256 / 64 (below 1: the
wider blocks win). The machine and the same run's SGEMM print first: the machine is shared.
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
WIDTHS = (64, linear.TILED_COLUMNS)


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


def side_by_side(call, repeat: int) -> dict[int, float]:
    """Median seconds of `call` at each block width, the widths alternated call by call."""
    times: dict[int, list[float]] = {width: [] for width in WIDTHS}
    default = linear.TILED_COLUMNS
    try:
        for width in WIDTHS:  # compiled and warm at both
            linear.TILED_COLUMNS = width
            call()
        for _ in range(repeat):
            for width in WIDTHS:
                linear.TILED_COLUMNS = width
                start = time.perf_counter()
                call()
                times[width].append(time.perf_counter() - start)
    finally:
        linear.TILED_COLUMNS = default
    return {width: float(np.median(found)) for width, found in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64,128,256")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s")
    narrow, wide = WIDTHS
    print(
        f"{'rows':>5s} {'inputs':>6s} {'outputs':>7s} {'pass':12s} {narrow:>4d} cols  {wide}/{narrow}"
    )
    for inputs, outputs in SHAPES:
        for n in (int(v) for v in args.rows.split(",")):
            if inputs * outputs > 1 << 24 and n > 64:
                continue  # the classifier at its own batch
            for name, call in passes(n, inputs, outputs).items():
                found = side_by_side(call, args.repeat)
                print(
                    f"{n:5d} {inputs:6d} {outputs:7d} {name:12s} {found[narrow] * 1e3:7.2f} ms"
                    f"  {found[wide] / found[narrow]:6.2f}"
                )


if __name__ == "__main__":
    main()
