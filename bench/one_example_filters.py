"""Benchmark: tied filters' three passes on one example and on 4 (each example along its
positions), against the same passes on a batch of 8 (the products along the batch), PyTorch's
at one example where it is installed, and the machine's SGEMM.

    python bench/one_example_filters.py [--seconds 0.5]

One example (a `predict` of one image, a rank's piece of one example) runs each pass as
products along an output row's positions (`runtime/kernels/filter_one_example.py`), and so
does each of a batch narrower than a vector (`filter_one_example.by_example`), whose
products along the batch were matrix-vector products at one example (VGG-19's forward at
batch 1: 3 GFLOP/s) and filled a quarter of each vector at 2. Each figure is GFLOP/s of the best
sustained rate over `--seconds`, float32, on every Numba thread; the shapes are VGG-19's and
ResNet's 3×3 layers and ResNet's 7×7 stem. The machine's facts and SGEMM print beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.kernels import sgemm_gflops
from bench.machine_facts import describe, machine_facts
from runtime.kernels import filter_packed
from runtime.kernels.layout import pack_activations, pack_weights

#: (C, H = W, K, R = S, stride): 3×3 layers of VGG-19 and ResNet, and ResNet's stem
SHAPES = ((64, 56, 64, 3, 1), (128, 28, 128, 3, 1), (256, 14, 256, 3, 1), (3, 224, 64, 7, 2))


def rate(call, flops: float, seconds: float) -> float:
    call()  # compiled, warmed
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        call()
        count += 1
    return flops * count / (time.perf_counter() - start) / 1e9


def ours(n: int, c: int, h: int, k: int, r: int, stride: int, seconds: float) -> list[float]:
    """GFLOP/s of the forward, input-gradient and weight-gradient passes at batch `n`."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    w = rng.standard_normal((k, 1, 1, c, r, r, 1, 1)).astype(np.float32)
    xp, wp, pad = pack_activations(x), pack_weights(w), r // 2
    dy = filter_packed.forward_packed(xp, wp, stride, pad)
    dw = np.zeros_like(wp)
    p = dy.shape[0]
    flops = 2.0 * n * k * c * r * r * p * p
    passes = (
        lambda: filter_packed.forward_packed(xp, wp, stride, pad),
        lambda: filter_packed.backward_data_packed(dy, wp, (h, h), stride, pad),
        lambda: filter_packed.backward_filter_packed(dy, xp, (r, r), stride, pad, False, None, dw),
    )
    return [rate(call, flops, seconds) for call in passes]


def torch_rates(c: int, h: int, k: int, r: int, stride: int, seconds: float) -> list[float]:
    """PyTorch's conv2d forward and both gradients at batch 1, or [] where it is missing."""
    try:
        import torch
    except ImportError:
        return []
    x = torch.randn(1, c, h, h, requires_grad=True)
    w = torch.randn(k, c, r, r, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, stride=stride, padding=r // 2)
    grad = torch.randn_like(y)
    flops = 2.0 * k * c * r * r * y.shape[2] * y.shape[3]

    def forward() -> None:
        with torch.no_grad():
            torch.nn.functional.conv2d(x, w, stride=stride, padding=r // 2)

    def both_gradients() -> None:
        out = torch.nn.functional.conv2d(x, w, stride=stride, padding=r // 2)
        torch.autograd.grad(out, (x, w), grad)

    return [rate(forward, flops, seconds), rate(both_gradients, 3 * flops, seconds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s")
    print("shape (C, H, K, R, stride)   batch 1: fwd / dx / dw    batch 4: fwd / dx / dw"
          "    batch 8: fwd / dx / dw    PyTorch batch 1: fwd / all three")  # fmt: skip
    for c, h, k, r, stride in SHAPES:
        shown = [
            " / ".join(f"{v:5.1f}" for v in ours(n, c, h, k, r, stride, args.seconds))
            for n in (1, 4, 8)
        ]
        peer = torch_rates(c, h, k, r, stride, args.seconds)
        theirs = " / ".join(f"{v:5.1f}" for v in peer) if peer else "not installed"
        print(f"{(c, h, k, r, stride)!s:28} {'  '.join(f'{v:22}' for v in shown)} {theirs}",
              flush=True)  # fmt: skip
    print(f"SGEMM after: {sgemm_gflops():.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
