"""`legion-nn render NETWORK|GRAPH.json -o F.svg|png|pdf|dot [...]`: draw a task graph.

The source is a task-graph JSON (`legion-nn graph --json`; recognised by its `format` key) or a
network, lowered at `--batch`. Either is verified before drawing, so a broken graph fails with
`verify`'s message rather than a misleading picture. Past `--max-nodes` nodes the full view gives
way to the layer view, with a note on stderr; `--collapse layer` or `--collapse none` decides
explicitly. The drawing is `visualize.dot`'s, the file writing `visualize.render_file`'s.
"""

from __future__ import annotations

import argparse
import sys

NAME = "render"
HELP = "draw a network's task graph, or a task-graph JSON, with Graphviz"
NETWORK_BATCH = 256
#: past this many nodes the layer view is drawn unless --collapse says otherwise: the full view of
#: the seed (77 nodes) reads well, vgg19's (386) takes dot long and reads as a texture
MAX_NODES = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="NETWORK|GRAPH.json",
        help="a built-in network (seed-lcn, seed-lcn-small, three-layer-convnet, vgg19), "
        "a JSON/TOML spec file, or a task-graph JSON from `legion-nn graph --json`",
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="F",
        help="output file; its suffix picks the format: .svg, .png, .pdf or .dot",
    )
    parser.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help=f"batch size a network is lowered at (default {NETWORK_BATCH})",
    )
    parser.add_argument("--forward-only", action="store_true", help="draw the forward pass only")
    parser.add_argument(
        "--collapse",
        choices=("layer", "none"),
        help="layer: one node per layer, edges as wide as the bytes between layers; "
        "none: every task and tensor (default: by --max-nodes)",
    )
    parser.add_argument(
        "--max-nodes",
        type=int,
        default=MAX_NODES,
        metavar="N",
        help=f"draw one node per layer when the full view has more than N nodes "
        f"(default {MAX_NODES})",
    )
    parser.add_argument(
        "--rankdir",
        choices=("TB", "LR"),
        default="TB",
        help="top to bottom (default) or left to right",
    )
    parser.add_argument(
        "--rects",
        choices=("compact", "seed"),
        default="compact",
        help="compact: 0..[256 1 41 41] (default); seed: the seed's Rect(array(...)) form",
    )


def _load(args: argparse.Namespace):
    from legion_nn.sources import load_source_graph

    return load_source_graph(args.source, args.batch, NETWORK_BATCH)


def run(args: argparse.Namespace) -> int:
    from legion_nn.errors import LegionNNError
    from legion_nn.verify import verify
    from visualize.dot import forward_only, node_count, to_graphviz
    from visualize.render_file import check_output, write_rendering

    check_output(args.output)
    if args.max_nodes < 1:
        raise LegionNNError(f"--max-nodes must be at least 1, got {args.max_nodes}")
    graph = _load(args)
    verify(graph)
    if args.forward_only:
        graph = forward_only(graph)

    nodes = node_count(graph)
    collapse = args.collapse
    if collapse is None:
        collapse = "layer" if nodes > args.max_nodes else "none"
        if collapse == "layer":
            print(
                f"legion-nn render: {nodes} nodes is more than --max-nodes {args.max_nodes}: "
                "drawing one node per layer (--collapse none draws them all)",
                file=sys.stderr,
            )
    title = None
    if args.forward_only:
        title = (
            f"{graph.network or 'task graph'}, batch {graph.batch}, forward only: "
            f"{len(graph.tasks)} tasks, {len(graph.tensors)} tensors"
        )
    digraph = to_graphviz(
        graph,
        collapse=None if collapse == "none" else collapse,
        rankdir=args.rankdir,
        rects=args.rects,
        title=title,
    )
    written = write_rendering(digraph, args.output)
    if collapse == "layer":
        layers = len({task.layer for task in graph.tasks})
        what = f"{layers} layers from {len(graph.tasks)} tasks"
    else:
        what = f"{len(graph.tasks)} tasks, {len(graph.tensors)} tensors"
    print(f"wrote {written} ({what})")
    return 0
