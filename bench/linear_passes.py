"""Benchmark: the linear kernels' passes at one layer's shape, as shares of the same run's SGEMM,
beside NumPy's BLAS computing the same products.

    python bench/linear_passes.py [--rows 64] [--inputs 46656] [--outputs 3034] [--repeat 5]
        [--tree DIR]

The default shape is the seed classifier's at batch 64 (3034 × 46656 float32 weights, 566 MB).
The passes are the forward x·wᵀ, the input's gradient dy·w, the weight gradient dyᵀ·x, and the
weight gradient that steps Adam as it goes (`linear.linear_weight_grad_step`, the gradient never
stored) beside the same two unfused (the gradient into memory, then `OptimizerStep.apply`).
Each figure is the median of `--repeat` calls after one that compiles and warms, on operands
placed as the runtime places its buffers (`runtime.aligned`) and under a step's kernel
settings (`runtime.kernels.step_settings`). `--tree DIR`
imports the kernels from another checkout of the project: run it on two trees in turn
(`git worktree add /tmp/base REV`) to compare revisions, alternating the runs, since this
machine is shared. The machine's facts print first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def passes(rows: int, inputs: int, outputs: int) -> dict[str, tuple[Callable, Callable | None]]:
    """Per pass, (legion-nn's call, NumPy's BLAS call of the same product or None)."""
    from runtime.aligned import aligned_copy, aligned_zeros
    from runtime.kernels import linear
    from runtime.kernels.update import adam_step

    rng = np.random.default_rng(0)
    x = aligned_copy(rng.random((rows, inputs, 1, 1), np.float32))
    w = aligned_copy(rng.random((outputs, inputs, 1, 1), np.float32))
    dy = aligned_copy(rng.random((rows, outputs, 1, 1), np.float32))
    dw, m, v = (aligned_zeros(w.shape, np.float32) for _ in range(3))
    # a learning rate that leaves the weights as good as unchanged over the repeats
    step = adam_step(w, m, v, 1e-12, 0.9, 0.999, 1e-8, 1)
    x2, w2, dy2, dw2 = (a.reshape(a.shape[0], -1) for a in (x, w, dy, dw))

    def unfused():
        linear.linear_weight_grad_accumulate(dy, x, dw, accumulate=False)
        step.apply(dw)

    return {
        "forward": (lambda: linear.linear_forward(x, w), lambda: x2 @ w2.T),
        "input grad": (lambda: linear.linear_input_grad(dy, w, x.shape), lambda: dy2 @ w2),
        "weight grad": (
            lambda: linear.linear_weight_grad_accumulate(dy, x, dw, accumulate=False),
            lambda: np.matmul(dy2.T, x2, out=dw2),
        ),
        "weight grad + adam": (lambda: linear.linear_weight_grad_step(dy, x, step), None),
        "weight grad, then adam": (unfused, None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--inputs", type=int, default=46656)
    parser.add_argument("--outputs", type=int, default=3034)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to import from")
    args = parser.parse_args()
    if min(args.rows, args.inputs, args.outputs, args.repeat) < 1:
        print("linear_passes: --rows, --inputs, --outputs and --repeat must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    if not (args.tree / "runtime" / "kernels" / "linear.py").is_file():
        print(f"linear_passes: --tree {args.tree}: not a checkout of legion-nn", file=sys.stderr)
        return 2
    sys.path[:0] = [str(args.tree.resolve()), str(ROOT)]  # the tree's kernels, before any import
    from bench.kernels import sgemm_gflops
    from bench.machine_facts import describe, machine_facts
    from bench.timing import call_seconds

    print(describe(machine_facts()))
    sgemm = sgemm_gflops()
    flop = 2 * args.rows * args.inputs * args.outputs
    print(f"tree {args.tree.resolve()}; SGEMM {sgemm:.1f} GFLOP/s; rows {args.rows}, "
          f"inputs {args.inputs}, outputs {args.outputs}")  # fmt: skip
    print(f"{'pass':24s} {'legion-nn ms':>12s} {'%SGEMM':>7s} {'BLAS ms':>8s} {'%SGEMM':>7s}")
    from runtime.kernels.step_settings import step_kernel_settings

    for name, (ours, blas) in passes(args.rows, args.inputs, args.outputs).items():
        with step_kernel_settings():  # the threads and floating-point settings of a step
            seconds = statistics.median(call_seconds(ours, args.repeat))
        line = f"{name:24s} {seconds * 1e3:12.2f} {flop / seconds / 1e9 / sgemm:7.0%}"
        if blas is not None:
            theirs = statistics.median(call_seconds(blas, args.repeat))
            line += f" {theirs * 1e3:8.2f} {flop / theirs / 1e9 / sgemm:7.0%}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
