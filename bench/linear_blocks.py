"""Benchmark: the linear kernels under two values of one of their block settings, side by side in
one process: b read in blocks of `TILED_COLUMNS` columns, 256 (the default) against 64 (the
block before), or c cut into `TILED_TASKS_PER_THREAD` blocks a thread, 8 (the default) against
16 (one thread's before the count was per thread: each row block reads all of b again), or the
input's gradient computed as is (0) against transposed (1), the two orders it races on a
machine (`linear._raced_input_grad`), or b's blocks read in place (off) against packed (on,
where `linear._packs` says to).

    python bench/linear_blocks.py [--setting columns|tasks|transposed|packed]
        [--rows 16,32,64,128,256] [--repeat 9]

Each line is one shape (rows, inputs, outputs) and pass (the forward x·wᵀ, the input's gradient
dy·w, the weight gradient's accumulation dyᵀ·x, and the weight gradient stepping Adam as it
goes), the median of `--repeat` calls alternated
between the two values: the time with the first and the ratio second / first (below 1: the
default wins; for `transposed`, below 1: the transposed order wins). The operands are placed as
the runtime places its buffers (`runtime.aligned`: each at a cache line): NumPy's own arrays
start 16 bytes into a line, which slowed the order that reads w's rows as vectors (the input's
gradient as is) by up to 1.4× on an Intel Xeon VM. The machine and the same run's SGEMM print
first: the machine is shared. Run it with `NUMBA_NUM_THREADS=1` for a rank on a core of its own
(a pipeline stage's).
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
from runtime.aligned import aligned_copy, aligned_empty, aligned_zeros
from runtime.kernels import linear
from runtime.kernels.blas import NO_TRANS
from runtime.kernels.step_settings import step_kernel_settings
from runtime.kernels.update import adam_step

#: (inputs, outputs): an MLP's square layers, a narrowing and a widening one, a small one, and
#: the seed classifier's
SHAPES = ((2048, 2048), (4096, 1024), (1024, 4096), (512, 512), (46656, 3034))
#: more bytes than any b has: b's blocks never packed
NEVER = 1 << 40
#: --setting: (the module's name for it, (the value before, the default)); `transposed` is the
#: input's gradient's order, not a setting of the module
SETTINGS = {
    "columns": ("TILED_COLUMNS", (64, linear.TILED_COLUMNS)),
    "tasks": ("TILED_TASKS_PER_THREAD", (16, linear.TILED_TASKS_PER_THREAD)),
    "transposed": (None, (0, 1)),
    "packed": ("PACKED_LEAST_BYTES", (NEVER, linear.PACKED_LEAST_BYTES)),
}


def passes(n: int, inputs: int, outputs: int, setting: str):
    """The three passes at one shape; under `transposed` the input's gradient alone, in the
    order the setting's value names."""
    rng = np.random.default_rng(0)
    x = aligned_copy(rng.random((n, inputs, 1, 1), np.float32))
    w = aligned_copy(rng.random((outputs, inputs, 1, 1), np.float32))
    dy = aligned_copy(rng.random((n, outputs, 1, 1), np.float32))
    if setting == "transposed":
        dy2, w2 = dy.reshape(n, outputs), w.reshape(outputs, inputs)
        dx = aligned_empty((n, inputs), np.float32)
        return {
            "input grad": lambda transposed: linear.product(
                dy2, NO_TRANS, w2, NO_TRANS, dx, transposed=bool(transposed)
            )
        }
    dw = aligned_zeros(w.shape, np.float32)
    # a learning rate that leaves the weights as good as unchanged over the calls
    step = adam_step(w, *(aligned_zeros(w.shape, np.float32) for _ in range(2)), 1e-12, 0.9,
                     0.999, 1e-8, 1)  # fmt: skip
    dy2, w2 = dy.reshape(n, outputs), w.reshape(outputs, inputs)
    dx = aligned_empty((n, inputs), np.float32)
    return {
        "forward": lambda _: linear.linear_forward(x, w),
        # in the order as is (which `_raced_input_grad` would otherwise choose once, under the
        # first value)
        "input grad": lambda _: linear.product(dy2, NO_TRANS, w2, NO_TRANS, dx),
        "weight grad": lambda _: linear.linear_weight_grad_accumulate(dy, x, dw),
        "wgrad + adam": lambda _: linear.linear_weight_grad_step(dy, x, step),
    }


def side_by_side(call, setting: str, repeat: int) -> dict[int, float]:
    """Median seconds of `call` at each value of `setting`, the values alternated call by call
    (each call is given the value)."""
    name, values = SETTINGS[setting]
    times: dict[int, list[float]] = {value: [] for value in values}
    default = getattr(linear, name) if name else None
    try:
        for value in values:  # compiled and warm at both
            if name:
                setattr(linear, name, value)
            call(value)
        for _ in range(repeat):
            for value in values:
                if name:
                    setattr(linear, name, value)
                start = time.perf_counter()
                call(value)
                times[value].append(time.perf_counter() - start)
    finally:
        if name:
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
    named = {
        narrow: "off" if narrow == NEVER else str(narrow),
        wide: "on" if narrow == NEVER else str(wide),
    }
    print(
        f"{'rows':>5s} {'inputs':>6s} {'outputs':>7s} {'pass':12s} "
        f"{named[narrow]:>4s} {args.setting}"
        f"  {named[wide]}/{named[narrow]}"
    )
    with step_kernel_settings():  # the threads and floating-point settings of a step
        for inputs, outputs in SHAPES:
            for n in (int(v) for v in args.rows.split(",")):
                if inputs * outputs > 1 << 24 and n > 64:
                    continue  # the classifier at its own batch
                for name, call in passes(n, inputs, outputs, args.setting).items():
                    found = side_by_side(call, args.setting, args.repeat)
                    print(
                        f"{n:5d} {inputs:6d} {outputs:7d} {name:12s} "
                        f"{found[narrow] * 1e3:7.2f} ms  {found[wide] / found[narrow]:6.2f}"
                    )


if __name__ == "__main__":
    main()
