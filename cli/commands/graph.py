"""`legion-nn graph NETWORK|DUMP|GRAPH.json [--batch N] [--json F] [--text]`: lower (or import),
verify, print or export."""

from __future__ import annotations

import argparse
import sys

from cli.commands import add_step_arguments, load_step

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
    add_step_arguments(parser, optimizer="sgd")  # the seed's graph: plain SGD, no state
    parser.add_argument("--json", metavar="F", help="write the task-graph JSON to F")
    parser.add_argument(
        "--text",
        action="store_true",
        help="print the graph in the seed's text form (the default without --json)",
    )


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_text
    from legion_nn.graphjson import dumps
    from legion_nn.textform import graph_text
    from legion_nn.verify import verify

    graph = load_step(args, args.network, DEFAULT_BATCH)
    verify(graph)
    if args.json:
        write_text(args.json, dumps(graph))
    if args.text or not args.json:
        sys.stdout.write(graph_text(graph))
    return 0
