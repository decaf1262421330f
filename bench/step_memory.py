"""Benchmark: peak memory of one training step against the bytes of the step's tensors.

    python bench/step_memory.py [NETWORK] [--batch 64] [--dtype float32]

Runs one step (after a warm-up step, so Numba compilation is not counted) in a fresh process and
reports the process's peak resident memory above its baseline (after imports and data), next to
the total bytes of the graph's tensors. The issue's goal: seed-lcn at batch 64 under 1.3×.
"""

from __future__ import annotations

import argparse

import numpy as np

from legion_nn.networks import load_network
from runtime.adapters import StepContext
from runtime.process_memory import peak_rss_bytes, rss_bytes
from runtime.rank_executor import one_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("network", nargs="?", default="seed-lcn")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args()

    net = load_network(args.network)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch,) + net.input).astype(np.dtype(args.dtype))
    y = rng.integers(0, net.classes, args.batch).astype(np.int32)
    # Compile every kernel on a tiny batch first, so compilation does not count.
    small = net.lower(batch=2, dtype=args.dtype)
    one_process().run(small, StepContext(0, inputs=x[:2], labels=y[:2]))
    del small

    graph = net.lower(batch=args.batch, dtype=args.dtype)
    tensor_bytes = sum(t.nbytes for t in graph.tensors.values())
    baseline = rss_bytes()
    one_process().run(graph, StepContext(0, inputs=x, labels=y))
    step_peak = peak_rss_bytes() - baseline
    print(
        f"{args.network} batch {args.batch} {args.dtype}: tensors {tensor_bytes / 2**30:.3f} GiB, "
        f"step peak above baseline {step_peak / 2**30:.3f} GiB, ratio {step_peak / tensor_bytes:.3f}"
    )
    kinds: dict[str, int] = {}
    for tensor in graph.tensors.values():
        kinds[tensor.kind] = kinds.get(tensor.kind, 0) + tensor.nbytes
    print("  by kind: " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in sorted(kinds.items())))


if __name__ == "__main__":
    main()
