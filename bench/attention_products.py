"""Benchmark: attention's products of two activations against the machine's SGEMM.

    python bench/attention_products.py [--rounds 15] [--shapes 16x4x128x64,8x16x512x64]

For each (N, H, T, D), float32, the four calls a GPT block makes of `runtime.kernels.attention`
on (N, H, T, D) heads as the step's buffers hold them (C-contiguous): the scores Q·Kᵀ scaled
by 1/√D, the context P·V, and their gradients. Beside them: the scores' GEMM alone (on Kᵀ
already laid out, without the transposing copy the call makes), `torch.matmul` on the same
arrays where PyTorch is installed, and a 2048² SGEMM with the BLAS kernels OpenBLAS picks for
the CPU (the benchmark runs itself again without `OPENBLAS_CORETYPE` where the environment pins
them). The calls are
interleaved round by round, each after a pause (the other calls' threads stop spinning) and
repeated on warm caches as `bench kernels` times the filter passes, and each figure is the
best of `--rounds`, as GFLOP/s and as a fraction of the SGEMM of the same run: the machine is
shared and its speed moves from minute to minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import torch_available, unpinned_environment
from bench.machine_facts import describe, machine_facts
from runtime.kernels import attention

DEFAULT_SHAPES = "16x4x128x64,8x16x512x64"
#: the pause before each call: BLAS's and PyTorch's threads spin for a while after their calls,
#: and took a core from the call timed next (the scores, after SGEMM, measured 27 ms at
#: (8, 16, 512, 64) in the interleaved rounds, against 16 ms run alone)
SETTLE_S = 0.2
#: the calls run after the pause, before the one timed: the cores back at speed and the
#: operands in cache, however short the call
WARM_S = 0.05


def calls(n: int, h: int, t: int, d: int) -> dict[str, tuple[Callable[[], object], float]]:
    """name -> (call, its floating-point operations)."""
    rng = np.random.default_rng(0)
    q, k, v, dc = (rng.standard_normal((n, h, t, d), dtype=np.float32) for _ in range(4))
    p = rng.random((n, h, t, t), dtype=np.float32)
    ds = rng.standard_normal((n, h, t, t), dtype=np.float32)
    scores, context = np.empty((n, h, t, t), np.float32), np.empty((n, h, t, d), np.float32)
    # the gradients go into buffers of their own, as the step's are: a fresh one of the scores'
    # size a call would time its page faults (134 MB at (8, 16, 512, 64))
    dq, dk, dv = (np.empty((n, h, t, d), np.float32) for _ in range(3))
    dp = np.empty((n, h, t, t), np.float32)
    scale = 1 / np.sqrt(d)
    flops = 2.0 * n * h * t * t * d
    laid_k = attention._swapped(k, scale)
    found = {
        "scores": (lambda: attention.matmul_forward(q, k, True, scale, out=scores), flops),
        "scores, its GEMM": (lambda: attention._product(q, False, laid_k, scores), flops),
        "context": (lambda: attention.matmul_forward(p, v, False, 1.0, out=context), flops),
        "scores' gradient": (
            lambda: attention.matmul_backward(ds, q, k, True, scale, da=dq, db=dk),
            2 * flops,
        ),
        "context's gradient": (
            lambda: attention.matmul_backward(dc, p, v, da=dp, db=dv),
            2 * flops,
        ),
    }
    if torch_available():
        import torch

        tq, tk, tp, tv = (torch.from_numpy(x) for x in (q, k, p, v))
        found["torch scores"] = (lambda: torch.matmul(tq * scale, tk.transpose(-1, -2)), flops)
        found["torch context"] = (lambda: torch.matmul(tp, tv), flops)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxHxTxD,...")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 4 or min(s) < 1 for s in shapes) or args.rounds < 1:
            raise ValueError
    except ValueError:
        print(f"attention_products: bad --shapes {args.shapes!r} or --rounds", file=sys.stderr)
        return 2
    if os.environ.get("OPENBLAS_CORETYPE"):
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], unpinned_environment())
    print(describe(machine_facts()))
    square = np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32)
    for shape in shapes:
        found = calls(*shape)
        found["SGEMM 2048²"] = (lambda: square @ square, 2.0 * 2048**3)
        best = dict.fromkeys(found, float("inf"))
        for call, _ in found.values():
            call()
        for _ in range(args.rounds):
            for name, (call, _) in found.items():
                time.sleep(SETTLE_S)
                warm_until = time.perf_counter() + WARM_S
                while time.perf_counter() < warm_until:
                    call()
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        ceiling = found["SGEMM 2048²"][1] / best["SGEMM 2048²"] / 1e9
        print(f"N, H, T, D = {shape}: SGEMM {ceiling:.0f} GFLOP/s")
        for name, (_, flops) in found.items():
            if name != "SGEMM 2048²":
                rate = flops / best[name] / 1e9
                print(f"  {name:<20} {best[name] * 1e3:8.3f} ms {rate:7.1f} GFLOP/s "
                      f"{rate / ceiling:6.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
