"""Benchmark: on one thread, each kernel's plain loops against its parallel loops.

    python bench/threaded_twins.py [--rounds 3] [--repeat 15]

A caller with one Numba thread (a rank of `mpiexec -n 2` on two cores, a rank of the emulated
cluster) runs the plain-loop twin of each kernel with parallel loops (`runtime.kernels.threaded`),
which compiles in about half the time. This times what it runs against what it ran before: for
the linear product at 32 and 128 rows of a 2048×2048 weight, an untied filter's forward and input
gradient (batch 64, 16 channels, 32×32), and a few streaming kernels over 4M floats (ReLU and its
gradient, tanh, Adam, the sum of squares). Each twin is put in the kernel's place in turn, and
the figure is the median over `--rounds` alternations of each one's median of `--repeat` calls.
The process runs on one thread (`NUMBA_NUM_THREADS=1` is set before Numba loads); the machine's
facts print first, since it is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # before Numba loads: the whole run on one thread
    os.environ["NUMBA_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.machine_facts import describe, machine_facts
from bench.timing import call_seconds
from runtime.kernels import filter_packed, layout, linear, nonlinear, update


def cases(rng: np.random.Generator) -> list[tuple[str, object, str, object]]:
    """(label, module, kernel's name in it, a call that runs the kernel through its wrapper)."""
    found = []
    weights = rng.standard_normal((2048, 2048)).astype(np.float32)
    # w as the tiled product's b, read through packed blocks where its rows share cache sets
    product_kernel = "_packed_product" if linear._packs(weights) else "_tiled_product"
    for rows in (32, 128):
        x = rng.standard_normal((rows, 2048)).astype(np.float32)
        out = np.empty((rows, 2048), np.float32)
        found.append((f"linear {rows}x2048x2048", linear, product_kernel,
                      lambda x=x, out=out: linear.product(x, linear.NO_TRANS, weights,
                                                          linear.NO_TRANS, out)))  # fmt: skip
    x = rng.standard_normal((64, 16, 32, 32)).astype(np.float32)
    w = rng.standard_normal((16, 1, 1, 16, 3, 3, 30, 30)).astype(np.float32)
    xp, wp = layout.pack_activations(x), layout.pack_weights(w)
    yp = filter_packed.forward_packed(xp, wp, 1, 0)
    found.append(("untied filter forward", filter_packed, "_forward",
                  lambda: filter_packed.forward_packed(xp, wp, 1, 0)))  # fmt: skip
    found.append(("untied filter input gradient", filter_packed, "_backward_data",
                  lambda: filter_packed.backward_data_packed(yp, wp, xp.shape[:2], 1, 0)))  # fmt: skip
    big = rng.standard_normal(4_000_000).astype(np.float32)
    relu = nonlinear.filterNL_forward(big, "relu")
    found.append(
        ("relu 4M", nonlinear, "_elementwise", lambda: nonlinear.filterNL_forward(big, "relu"))
    )
    found.append(("relu gradient 4M", nonlinear, "_elementwise",
                  lambda: nonlinear.filterNL_backward(big, relu, "relu")))  # fmt: skip
    found.append(
        ("tanh 4M", nonlinear, "_elementwise", lambda: nonlinear.filterNL_forward(big, "tanh"))
    )
    params, first, second = big.copy(), np.zeros_like(big), np.zeros_like(big)
    adam = update.adam_step(params, first, second, 0.1, 0.9, 0.999, 1e-8, 1)
    found.append(("adam 4M", update, "_apply", lambda: adam.apply(big)))
    found.append(("sum of squares 4M", update, "_sum_squares_chunked",
                  lambda: update._sum_squares_chunked(big)))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(describe(machine_facts()))
    print(f"{'kernel':32s} {'plain':>10s} {'parallel':>10s} {'plain/parallel':>15s}")
    for label, module, name, call in cases(np.random.default_rng(0)):
        kernel = getattr(module, name)
        times: dict[str, list[float]] = {"serial": [], "parallel": []}
        try:
            for _ in range(args.rounds):
                for twin, taken in times.items():
                    setattr(module, name, getattr(kernel, twin))
                    taken.append(statistics.median(call_seconds(call, args.repeat)))
        finally:
            setattr(module, name, kernel)
        plain, parallel = (statistics.median(times[t]) for t in ("serial", "parallel"))
        print(f"{label:32s} {plain * 1e3:8.3f}ms {parallel * 1e3:8.3f}ms {plain / parallel:15.3f}")


if __name__ == "__main__":
    main()
