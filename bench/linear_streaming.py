"""Benchmark: the linear forward's streaming loop against its tiled product, at small batches,
for weights from cache-sized to far larger than the caches.

    python bench/linear_streaming.py [--batches 2,16] [--classes 10,32,2048] [--repeat 7]

Each line is one shape: the forward product x·wᵀ, the best of `--repeat` calls, as the tiled
product's time over the loop's (above 1: the loop wins) and the loop's own time.
`runtime.kernels.linear.streams` picks the loop where this measured in its favour.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.kernels import best_seconds
from runtime.kernels import linear
from runtime.kernels.blas import NO_TRANS, TRANS

FEATURES = (3200, 32768, 131072, 262144, 1 << 20)


def measure(n: int, m: int, features: int, repeat: int) -> dict[str, float]:
    """Best seconds of the forward on each path for n rows, m weight rows of `features`."""
    rng = np.random.default_rng(0)
    x = rng.random((n, features), np.float32)
    w = rng.random((m, features), np.float32)
    y = np.empty((n, m), np.float32)
    chunk = linear.STREAMING_CHUNK
    calls = {
        "loop": lambda: linear._streaming_forward(x, w, chunk),
        "tiled": lambda: linear.product(x, NO_TRANS, w, TRANS, y),
    }
    return {name: best_seconds(call, repeat) for name, call in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="2,16")
    parser.add_argument("--classes", default="10,32,2048", help="weight rows (outputs) to try")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    for classes in (int(v) for v in args.classes.split(",")):
        for n in (int(v) for v in args.batches.split(",")):
            for features in FEATURES:
                if classes * features * 4 > 64 << 20:
                    continue
                timed = measure(n, classes, features, args.repeat)
                weights = classes * features * 4 / 2**20
                print(
                    f"outputs {classes:5d}, batch {n:3d}, weights {weights:6.2f} MiB: forward "
                    f"tiled/loop {timed['tiled'] / timed['loop']:5.2f} "
                    f"(loop {timed['loop'] * 1e6:8.1f} us)"
                )


if __name__ == "__main__":
    main()
