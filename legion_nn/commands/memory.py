"""`legion-nn memory DUMP|NETWORK [--ranks R] [--batch B] [--json F] [--plot F]`: peak memory.

SOURCE is a Chainer graph dump when it names an existing file that is not a spec file (.json,
.toml); otherwise a built-in network or a spec file, lowered at `--batch` (default 256). The
analysis and its rules are `legion_nn.memory`'s. Every output is checked before any is written,
and written atomically.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from legion_nn.commands import add_step_arguments

NAME = "memory"
HELP = "peak memory of one training step of a Chainer dump or a network, per data-parallel rank"
NETWORK_BATCH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="DUMP|NETWORK",
        help="a Chainer graph dump, a built-in network (seed-lcn, seed-lcn-small, "
        "three-layer-convnet, vgg19) or a JSON/TOML spec file",
    )
    parser.add_argument(
        "--ranks", type=int, default=1, metavar="R", help="data-parallel ranks (default 1)"
    )
    add_step_arguments(parser)
    parser.add_argument(
        "--batch",
        type=int,
        metavar="B",
        help="the global batch: overrides a dump's (the size of its label input `1`); "
        f"a network's defaults to {NETWORK_BATCH}",
    )
    parser.add_argument("--json", metavar="F", help="write the result as JSON to F")
    parser.add_argument(
        "--plot", metavar="F", help="plot live bytes over the schedule to F (.png, .pdf or .svg)"
    )


def _schedule(args: argparse.Namespace):
    from legion_nn.memory import schedule_from_dump, schedule_from_graph
    from legion_nn.sources import is_dump

    path = Path(args.source)
    if is_dump(path):
        from legion_nn.importers.chainer import parse_dump

        return schedule_from_dump(parse_dump(path), args.batch)
    from legion_nn.networks import load_network

    graph = load_network(args.source).lower(
        batch=args.batch or NETWORK_BATCH, dtype=args.dtype, optimizer=args.optimizer
    )
    return schedule_from_graph(graph)


def _size(n: int) -> str:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n:,} bytes ({n / unit:.2f} {name})"
    return f"{n:,} bytes"


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_bytes
    from legion_nn.errors import LegionNNError
    from visualize.render_file import check_plot

    if args.ranks < 1:
        raise LegionNNError(f"--ranks must be at least 1, got {args.ranks}")
    if args.batch is not None and args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    if args.plot:
        check_plot(args.plot)

    report = _schedule(args).analyze(args.ranks)
    result = report.to_json()
    outputs: list[tuple[str, bytes]] = []
    if args.json:
        outputs.append((args.json, (json.dumps(result, indent=1) + "\n").encode()))
    if args.plot:
        from visualize.memory import live_bytes_figure

        buffer = io.BytesIO()
        live_bytes_figure(report).savefig(buffer, format=check_plot(args.plot))
        outputs.append((args.plot, buffer.getvalue()))
    for path, data in outputs:
        write_bytes(path, data)

    ranks = "rank" if args.ranks == 1 else "ranks"
    total = result["forward_functions"] + result["backward_functions"]
    sys.stdout.write(
        f"{result['source']}: batch {result['batch']}, {args.ranks} data-parallel {ranks}\n"
        f"  functions   {result['forward_functions']} forward, "
        f"{result['backward_functions']} backward\n"
        f"  parameters  {_size(result['param_bytes'])}\n"
        f"  peak        {_size(result['peak_bytes'])} per rank at {result['peak_at']} "
        f"({result['peak_phase']}, function {result['peak_index'] + 1} of {total})\n"
    )
    return 0
