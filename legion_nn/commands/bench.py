"""`legion-nn bench kernels|scaling`: benchmarks, not tests.

- `kernels`: filter kernel throughput beside the machine's SGEMM, NumPy and PyTorch;
- `scaling`: training steps under `mpiexec` on 1, 2 and 4 ranks for each strategy, measured
  beside the cost model's calibrated prediction (see `runtime.bench_scaling`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from legion_nn.errors import LegionNNError

NAME = "bench"
HELP = "benchmarks: kernel GFLOP/s beside SGEMM and peers; distributed step time vs the model"
SUITES = ("kernels", "scaling")
IMPLS = ("legion-nn", "numpy", "torch")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", choices=SUITES, help="what to measure")
    parser.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    parser.add_argument(
        "--batch",
        metavar="N",
        type=_positive,
        nargs="+",
        default=[64, 256],
        help="batch sizes (default: 64 256)",
    )
    parser.add_argument(
        "--repeat",
        metavar="R",
        type=_positive,
        default=3,
        help="timed calls of ours per measurement, best kept (default: 3)",
    )
    parser.add_argument(
        "--rounds",
        metavar="R",
        type=_positive,
        default=3,
        help="sweeps over our measurements, best kept (default: 3)",
    )
    parser.add_argument(
        "--peer-repeat",
        metavar="R",
        type=_positive,
        default=2,
        help="timed calls of PyTorch per measurement (default: 2)",
    )
    parser.add_argument(
        "--impl",
        choices=IMPLS,
        nargs="+",
        default=list(IMPLS),
        help="implementations to measure (default: all)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--steps",
        metavar="S",
        type=_positive,
        default=6,
        help="scaling: the fewest training steps per job, the first 2 untimed; a job gets more where "
        "its timed steps would take under 1 s (default: 6)",
    )


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_text
    from runtime.bench_kernels import format_table, run_benchmark

    if args.json is not None:
        # fail before minutes of measuring, not after
        parent = Path(args.json).parent
        if not args.json or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise LegionNNError(f"--json: cannot write {args.json!r}")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.suite == "scaling":
        from runtime import bench_scaling

        if args.steps <= bench_scaling.WARMUP:
            raise LegionNNError(f"--steps must exceed the {bench_scaling.WARMUP} untimed steps")
        report = bench_scaling.run_scaling(
            steps=args.steps, progress=None if args.quiet else progress
        )
        print(bench_scaling.format_table(report), end="")
        if args.json:
            write_text(args.json, json.dumps(report, indent=1) + "\n")
        return 0

    report = run_benchmark(
        batches=tuple(args.batch),
        repeat=args.repeat,
        peer_repeat=args.peer_repeat,
        rounds=args.rounds,
        impls=tuple(dict.fromkeys(args.impl)),
        progress=None if args.quiet else progress,
    )
    print(format_table(report))
    if args.json:
        write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0
