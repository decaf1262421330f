"""`legion-nn memory SOURCE [--ranks R] [--strategy S] [--batch B] [--json F] [--plot F]`.

Without `--strategy`: the peak memory of one step of a Chainer graph dump or a network, per
data-parallel rank, by the framework-neutral schedule analysis of `legion_nn.liveness`. SOURCE is a
dump when it names an existing file that is not a spec file (.json, .toml); otherwise a built-in
network or a spec file, lowered at `--batch` (default 256).

With `--strategy` (data, model, spatial, auto or a grids file): what legion-nn's runtime holds on
each rank when it runs that plan (`runtime.step.rank_memory`): each rank's peak, its parts (parameters,
optimizer state, data, the activations, gradients, messages and scratch live at the peak, the
arena's unused space, the process baseline) and, with `--plot`, the bytes held over the step.
SOURCE is then anything `legion_nn.sources` reads. Every output is checked before any is written,
and written atomically.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from cli.commands import (
    add_homes_argument,
    add_step_arguments,
    load_planned,
    load_step,
    resolve_step,
)

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
    add_homes_argument(parser)
    parser.add_argument(
        "--batch",
        type=int,
        metavar="B",
        help="the global batch: overrides a dump's (the size of its label input `1`); "
        f"a network's defaults to {NETWORK_BATCH}",
    )
    parser.add_argument(
        "--strategy",
        metavar="S",
        help="predict legion-nn's runtime on this plan: data, model, spatial, auto or a grids "
        "JSON file (see `partition`)",
    )
    parser.add_argument(
        "--machine", metavar="F", help="machine JSON, for auto and the process baseline"
    )
    parser.add_argument("--json", metavar="F", help="write the result as JSON to F")
    parser.add_argument(
        "--plot", metavar="F", help="plot live bytes over the schedule to F (.png, .pdf or .svg)"
    )


def _schedule(args: argparse.Namespace):
    from legion_nn.liveness import schedule_from_dump, schedule_from_graph
    from legion_nn.sources import is_dump

    path = Path(args.source)
    if is_dump(path):
        from legion_nn.importers.chainer import parse_dump

        return schedule_from_dump(parse_dump(path), args.batch)

    graph = load_step(args, args.source, NETWORK_BATCH)
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

    if args.strategy is not None:
        return _run_plan(args)
    for flag, value in (("--machine", args.machine), ("--param-homes", args.param_homes)):
        if value is not None:
            raise LegionNNError(f"{flag} needs --strategy")
    report = _schedule(args).analyze(args.ranks)
    result = report.to_json()
    outputs: list[tuple[str, bytes]] = []
    if args.json:
        outputs.append((args.json, (json.dumps(result, indent=1) + "\n").encode()))
    if args.plot:
        from visualize.live_memory import live_bytes_figure

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


def _note(message: str) -> None:
    print(f"legion-nn memory: {message}", file=sys.stderr)


def _run_plan(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_bytes
    from legion_nn.verify import verify
    from partitioner.machine_file import load_machine
    from partitioner.strategy import check_ranks
    from runtime.step.model import StepModel
    from runtime.step.rank_memory import predict
    from visualize.render_file import check_plot

    check_ranks(args.ranks)
    machine = load_machine(args.machine)
    graph = load_planned(args, args.source, NETWORK_BATCH)
    verify(graph)
    model = StepModel(machine)
    with model.looking_ahead():
        graph, strategy, _, _ = resolve_step(args, graph, args.ranks, machine, model, _note, 30.0)
    plan = model.plan(graph, strategy, args.ranks)
    memories = predict(graph, plan, machine, programs=model.programs(graph, plan))
    fullest = max(memories.values(), key=lambda m: m.peak)
    result = {
        "network": graph.network,
        "batch": graph.batch,
        "ranks": args.ranks,
        "strategy": plan.strategy,
        "param_homes": "sharded" if plan.sharded else "replicated",
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        # DESIGN's keys, of the fullest rank: its peak, where, the parameters' bytes
        # (whole), and the step's forward and backward tasks
        "peak_bytes": fullest.peak,
        "peak_at": fullest.peak_task,
        "param_bytes": sum(t.nbytes for t in graph.tensors.values() if t.kind == "param"),
        "forward_functions": sum(t.phase == "forward" for t in graph.tasks),
        "backward_functions": sum(t.phase == "backward" for t in graph.tasks),
        "tasks": list(memories[0].tasks),
        "per_rank": [
            {
                "rank": rank,
                "peak_bytes": m.peak,
                "buffer_bytes": m.buffer_bytes,
                "peak_at": m.peak_task,
                "breakdown": m.breakdown(),
                "live_bytes": m.live().tolist(),
            }
            for rank, m in memories.items()
        ],
    }
    outputs: list[tuple[str, bytes]] = []
    if args.json:
        outputs.append((args.json, (json.dumps(result, indent=1) + "\n").encode()))
    if args.plot:
        from visualize.live_memory import rank_live_figure

        buffer = io.BytesIO()
        figure = rank_live_figure(
            {rank: m.live() - m.baseline for rank, m in memories.items()},
            max(m.buffer_bytes for m in memories.values()),
            machine.process_baseline_bytes,
            f"{graph.network}: batch {graph.batch}, {plan.label}",
        )
        figure.savefig(buffer, format=check_plot(args.plot))
        outputs.append((args.plot, buffer.getvalue()))
    for path, data in outputs:
        write_bytes(path, data)
    sys.stdout.write(_plan_table(result))
    return 0


def _plan_table(result: dict) -> str:
    # a rank's breakdown names what it holds at its own peak (one may hold no activations there)
    parts = list(dict.fromkeys(p for row in result["per_rank"] for p in row["breakdown"]))
    lines = [
        (
            f"{result['network']}: batch {result['batch']}, {result['ranks']} ranks, "
            f"{result['strategy']}, {result['param_homes']} homes, "
            f"{result['optimizer']} {result['dtype']}; "
            f"peak {_size(result['peak_bytes'])} per rank"
        ),
        f"  {'rank':>4} {'peak':>9} " + " ".join(f"{p[:9]:>9}" for p in parts) + "  peak at",
    ]
    for row in result["per_rank"]:
        cells = " ".join(f"{row['breakdown'].get(p, 0) / 2**20:9.2f}" for p in parts)
        lines.append(
            f"  {row['rank']:>4} {row['peak_bytes'] / 2**20:9.2f} {cells}  {row['peak_at']}"
        )
    return "\n".join(lines) + "\n"
