"""`legion-nn render NETWORK|GRAPH.json -o F.svg|png|pdf|dot [...]`: draw a task graph.

The source is a task-graph JSON (`legion-nn graph --json`; recognised by its `format` key) or a
network, lowered at `--batch`. Either is verified before drawing, so a broken graph fails with
`verify`'s message rather than a misleading picture. Past `--max-nodes` nodes the full view gives
way to the layer view, with a note on stderr; `--collapse layer` or `--collapse none` decides
explicitly. The drawing is `visualize.dot`'s, the file writing `visualize.render_file`'s.

With `--ranks R` the graph is planned on R ranks under `--strategy` (resolved as
`legion-nn partition` resolves it) and drawn with one cluster per rank and the messages between
them (`visualize.partition_dot`); `--max-nodes` then counts task pieces per rank, and the layer
view is one node per unit per rank. The plan is always the whole step's: `--forward-only` draws
its forward part.
"""

from __future__ import annotations

import argparse
import sys

from cli.commands import (
    add_homes_argument,
    add_step_arguments,
    load_planned,
    load_step,
    resolve_step,
)

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
    add_step_arguments(parser)
    add_homes_argument(parser)
    parser.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help=f"batch size a network is lowered at (default {NETWORK_BATCH})",
    )
    parser.add_argument("--forward-only", action="store_true", help="draw the forward pass only")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="with --ranks: draw the plan's simulated step instead, a lane per rank, each task a "
        "bar (a micro-batch's forward and backward coloured by micro-batch, the gaps its "
        "waiting: a pipeline's bubbles); -o F.png, .svg or .pdf",
    )
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
        "--ranks",
        type=int,
        metavar="R",
        help="draw the graph partitioned over R ranks: a cluster per rank, messages between them",
    )
    parser.add_argument(
        "--strategy",
        metavar="S",
        help='with --ranks: data, model, spatial, auto (default) or a JSON file {"grids": ...}',
    )
    parser.add_argument(
        "--machine",
        metavar="F",
        help="with --strategy auto: the machine JSON its cost model uses (as for partition)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=30.0,
        metavar="S",
        help="with --strategy auto: seconds it may search (default 30)",
    )
    parser.add_argument(
        "--rects",
        choices=("compact", "seed"),
        default="compact",
        help="compact: 0..[256 1 41 41] (default); seed: the seed's Rect(array(...)) form",
    )


def _load(args: argparse.Namespace):
    if args.ranks is not None:
        return load_planned(args, args.source, NETWORK_BATCH)  # `_plan` plans it
    return load_step(args, args.source, NETWORK_BATCH)


def _plan(args: argparse.Namespace, graph):
    """The step graph and its plan on `--ranks` (`graph`: `_load`'s)."""
    from legion_nn.errors import LegionNNError
    from partitioner.machine_file import load_machine
    from runtime.step.model import StepModel

    if args.ranks < 1:
        raise LegionNNError(f"--ranks must be at least 1, got {args.ranks}")
    machine = load_machine(args.machine)

    def note(message: str) -> None:
        print(f"legion-nn render: {message}", file=sys.stderr)

    model = StepModel(machine)
    with model.looking_ahead():
        graph, strategy, _, _ = resolve_step(
            args, graph, args.ranks, machine, model, note, args.time_limit, args.strategy or "auto"
        )
    return graph, model.plan(graph, strategy, args.ranks)


def _collapse(args: argparse.Namespace, nodes: int) -> str:
    if args.collapse is not None:
        return args.collapse
    if nodes <= args.max_nodes:
        return "none"
    print(
        f"legion-nn render: {nodes} nodes is more than --max-nodes {args.max_nodes}: "
        "drawing one node per layer (--collapse none draws them all)",
        file=sys.stderr,
    )
    return "layer"


def run(args: argparse.Namespace) -> int:
    from legion_nn.errors import LegionNNError
    from legion_nn.verify import verify
    from visualize.dot import forward_only, node_count, to_graphviz
    from visualize.render_file import check_output, write_rendering

    if args.timeline:
        return _run_timeline(args)
    check_output(args.output)
    if args.max_nodes < 1:
        raise LegionNNError(f"--max-nodes must be at least 1, got {args.max_nodes}")
    if args.ranks is None:
        for flag, value in (("--strategy", args.strategy), ("--machine", args.machine)):
            if value is not None:
                raise LegionNNError(f"{flag} applies to a partitioned drawing; give --ranks R too")
    graph = _load(args)
    verify(graph)
    if args.ranks is not None:
        return _run_partitioned(args, graph)
    if args.forward_only:
        graph = forward_only(graph)

    collapse = _collapse(args, node_count(graph))
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


def _run_timeline(args: argparse.Namespace) -> int:
    from legion_nn.errors import LegionNNError
    from legion_nn.micro_batches import schedule_of, stages_of
    from legion_nn.verify import verify
    from partitioner.machine_file import load_machine
    from runtime.step.prediction import every_rank_within_budget, predict_step
    from runtime.step.programs import build_programs
    from runtime.step.simulator import simulate_step
    from visualize.render_file import check_plot, write_figure
    from visualize.step_timeline import timeline_figure

    check_plot(args.output)
    if args.ranks is None:
        raise LegionNNError("--timeline draws a plan's step: give --ranks R too")
    graph = _load(args)
    verify(graph)
    graph, plan = _plan(args, graph)
    if not every_rank_within_budget(graph, plan.nranks):
        raise LegionNNError(
            f"--timeline: {plan.nranks} ranks of {len(graph.tasks)} tasks is more than the step "
            "simulator draws"
        )
    machine = load_machine(args.machine)
    programs = build_programs(graph, plan, machine, range(plan.nranks))
    step = predict_step(graph, plan, machine, programs=programs, simulate=simulate_step)
    micro_batches, schedule = schedule_of(graph)
    stages = stages_of(graph)
    pipeline = f", {stages} stages" if stages > 1 else ""
    if micro_batches > 1:
        pipeline += f", {micro_batches} micro-batches, {schedule}"
    title = f"{graph.network or 'task graph'}, batch {graph.batch}: {plan.label}{pipeline}"
    bars = [(r, programs[r].tasks[i].task, start, end) for r, i, start, end in step.timeline]
    write_figure(
        timeline_figure(bars, step.seconds, list(step.waiting), step.waiting_fraction, title),
        args.output,
    )
    print(f"wrote {args.output} ({plan.nranks} ranks, step {step.seconds:.5f} s simulated)")
    return 0


def _run_partitioned(args: argparse.Namespace, graph) -> int:
    from visualize.dot import forward_only
    from visualize.partition_dot import partition_graphviz, piece_count
    from visualize.render_file import write_rendering

    graph, plan = _plan(args, graph)
    tasks = {task.name for task in forward_only(graph).tasks} if args.forward_only else None
    collapse = _collapse(args, piece_count(graph, plan, tasks))
    title = (
        f"{graph.network or 'task graph'}, batch {graph.batch}"
        + (", forward only" if args.forward_only else "")
        + f": strategy {plan.label} on {plan.nranks} ranks"
    )
    digraph = partition_graphviz(
        graph,
        plan,
        tasks=tasks,
        collapse=None if collapse == "none" else collapse,
        rankdir=args.rankdir,
        rects=args.rects,
        title=title,
    )
    written = write_rendering(digraph, args.output)
    unit = "units" if collapse == "layer" else "tasks"
    print(f"wrote {written} ({args.ranks} ranks, {plan.label}, {unit} per rank)")
    return 0
