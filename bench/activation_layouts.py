"""Benchmark: activations converted between the (N, C, H, W) layout and the filter kernels'
(H, W, C, N), beside a plain copy of the same bytes and NumPy's copy of the transposed view.

    python bench/activation_layouts.py [--repeat 20]

The filter tasks convert their inputs, outputs and gradients each step (`layout.pack_activations`,
`unpack_activations`): at the seed's shapes about 130 MB a step of seed-lcn at batch 64. Each
figure is the best of `--repeat` calls, in milliseconds, on every Numba thread; the plain copy
(`np.copyto`) is the ceiling, the transposed view copied by NumPy the plain reference. The
machine's facts print first, since it is shared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.machine_facts import describe, machine_facts
from runtime.aligned import aligned_empty
from runtime.kernels import layout

#: (N, C, H, W): the seed's L0 output and L1 input, L1's output, and a wider, larger map
SHAPES = ((64, 64, 33, 33), (64, 64, 27, 27), (64, 32, 66, 66), (256, 64, 33, 33))


def best_ms(call, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def row(shape: tuple[int, int, int, int], repeat: int) -> tuple[float, ...]:
    """(pack, unpack, plain copy, NumPy's transposed copy) in ms for activations of `shape`."""
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    packed = layout.pack_activations(x)  # compiled on the first call, not timed
    back = aligned_empty(shape, np.float32)
    layout.unpack_activations(packed, back)
    if not np.array_equal(back, x):
        raise AssertionError(f"{shape}: the conversions do not invert each other")
    numpy_view = x.transpose(2, 3, 1, 0)
    return (
        best_ms(lambda: layout.pack_activations(x), repeat),
        best_ms(lambda: layout.unpack_activations(packed, back), repeat),
        best_ms(lambda: np.copyto(back, x), repeat),
        best_ms(lambda: np.copyto(packed, numpy_view), repeat),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(describe(machine_facts()))
    print(f"{'N, C, H, W':>18s} {'MB':>6s} {'pack':>7s} {'unpack':>7s} {'copy':>7s} {'numpy':>7s}")
    for shape in SHAPES:
        figures = row(shape, args.repeat)
        label = ", ".join(map(str, shape))
        megabytes = np.prod(shape) * 4 / 1e6
        print(f"{label:>18s} {megabytes:6.1f} " + " ".join(f"{v:7.2f}" for v in figures))


if __name__ == "__main__":
    main()
