"""Benchmark: time to lower and verify each built-in network.

    python bench/lowering.py [--batch 256] [--repeat 20]

Prints the best and median wall time of `Network.lower` and of `verify` per built-in, with the
graph's size. The issue's goal is seed-lcn at batch 256 "well under a second".
"""

from __future__ import annotations

import argparse
import statistics
import time

from legion_nn.networks import BUILTINS, load_network
from legion_nn.verify import verify


def timed(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(
        f"{'network':<22}{'tasks':>7}{'tensors':>9}{'lower best':>12}{'median':>10}"
        f"{'verify best':>13}{'median':>10}"
    )
    for name in BUILTINS:
        net = load_network(name)
        graph = net.lower(batch=args.batch)
        lower = timed(lambda net=net: net.lower(batch=args.batch), args.repeat)
        check = timed(lambda graph=graph: verify(graph), max(3, args.repeat // 4))
        print(
            f"{name:<22}{len(graph.tasks):>7}{len(graph.tensors):>9}"
            f"{lower[0] * 1e3:>10.2f}ms{lower[1] * 1e3:>8.2f}ms"
            f"{check[0] * 1e3:>11.2f}ms{check[1] * 1e3:>8.2f}ms"
        )


if __name__ == "__main__":
    main()
