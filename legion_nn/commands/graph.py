"""`legion-nn graph NETWORK|DUMP|GRAPH.json [--batch N] [--json F] [--text]`: lower (or import),
verify, print or export."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "graph"
DEFAULT_BATCH = 256
HELP = "lower a network to its task graph; print it (--text) or export it (--json F)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "network",
        help="a built-in (seed-lcn, seed-lcn-small, three-layer-convnet, vgg19), a JSON/TOML spec "
        "file, a Chainer graph dump or a task-graph JSON",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size (networks: default 256; dumps: override)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument(
        "--optimizer",
        default="sgd",
        choices=("sgd", "momentum", "adam"),
        help="the optimizer whose update tasks and state are lowered",
    )
    parser.add_argument("--json", metavar="F", help="write the task-graph JSON to F")
    parser.add_argument(
        "--text",
        action="store_true",
        help="print the graph in the seed's text form (the default without --json)",
    )


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_text
    from legion_nn.errors import LegionNNError
    from legion_nn.graphjson import dumps
    from legion_nn.networks import load_network
    from legion_nn.sources import is_dump, is_graph_json, load_source_graph
    from legion_nn.textform import graph_text
    from legion_nn.verify import verify

    if args.batch is not None and args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    path = Path(args.network)
    if is_dump(path) or is_graph_json(path):
        graph = load_source_graph(args.network, args.batch, DEFAULT_BATCH)
    else:
        graph = load_network(args.network).lower(
            batch=args.batch or DEFAULT_BATCH, dtype=args.dtype, optimizer=args.optimizer
        )
    verify(graph)
    if args.json:
        write_text(args.json, dumps(graph))
    if args.text or not args.json:
        sys.stdout.write(graph_text(graph))
    return 0
