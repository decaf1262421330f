"""`legion-nn partition NETWORK --ranks R --strategy S`: plan a step on R ranks and predict it.

NETWORK is what `legion_nn.sources` accepts: a built-in or spec file (lowered at `--batch`, default
256), a task-graph JSON, or a Chainer dump (imported at its own batch unless `--batch` overrides
it); the graph is verified before it is planned. A graph whose tasks can be cut over the batch
only, as an imported graph's are, has one plan to offer: `data`, which `auto` then is, while
`model` and `spatial` are refused with one line rather than quietly planned as `data`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cli.commands import (
    add_homes_argument,
    add_step_arguments,
    load_planned,
    resolve_step,
)

NAME = "partition"
DEFAULT_BATCH = 256
HELP = "partition a network over R ranks (data, model, spatial, auto) and predict its step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "network",
        help="a built-in, a JSON/TOML spec file, a task-graph JSON or a Chainer graph dump",
    )
    parser.add_argument("--ranks", type=int, default=None, help="number of ranks R")
    parser.add_argument(
        "--strategy",
        default="auto",
        help='data, model, spatial, auto, or a JSON file {"grids": {unit: [..]}} (default auto)',
    )
    add_step_arguments(parser)
    add_homes_argument(parser)
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"batch size (networks: default {DEFAULT_BATCH}; dumps: overrides the dump's)",
    )
    parser.add_argument(
        "--machine",
        metavar="F",
        help="machine JSON (default: 100 GFLOP/s, 12.5 GB/s, 2 us, 16 GiB per rank)",
    )
    parser.add_argument(
        "--calibrate",
        metavar="BENCH",
        help="per-op throughput from a `legion-nn bench kernels --json` report (see machine.py)",
    )
    parser.add_argument("--json", metavar="F", help="write the report as JSON to F")
    parser.add_argument("--sweep", metavar="LIST", help="comma-separated rank counts, e.g. 1,2,4")
    parser.add_argument(
        "--plot",
        metavar="F",
        help="draw which rank owns which region of each layer's output and weights, halos "
        "hatched (.png, .pdf or .svg); with --sweep: a PNG of the sweep",
    )
    parser.add_argument(
        "--time-limit", type=float, default=30.0, help="seconds auto may search (default 30)"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="simulate the step however large: a plan whose ranks all differ past 400,000 "
        "rank-task pairs (a message counts a sixth of one) is otherwise reported by its "
        "bulk-synchronous sum; vgg19's model plan on 1024 ranks takes some 30 s and 2 GB",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check the plan by brute force (coverage, producers, messages; verify_plan)",
    )


def _note(message: str) -> None:
    print(f"legion-nn partition: {message}", file=sys.stderr)


def _ranks_list(text: str) -> list[int]:
    from legion_nn.errors import LegionNNError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LegionNNError(f"--sweep must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise LegionNNError(f"--sweep needs positive rank counts, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_text
    from legion_nn.errors import LegionNNError
    from legion_nn.verify import verify
    from partitioner.machine_file import load_calibrated, load_machine
    from partitioner.report import report_json, sweep_table, table
    from partitioner.strategy import check_ranks
    from partitioner.verify_plan import verify_plan
    from runtime.step.model import StepModel
    from visualize.render_file import check_plot, write_figure

    if args.batch is not None and args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    if args.ranks is not None and args.ranks < 1:
        raise LegionNNError(f"--ranks must be at least 1, got {args.ranks}")
    if not args.time_limit >= 0:
        raise LegionNNError(f"--time-limit must be at least 0 seconds, got {args.time_limit}")
    if args.plot:
        check_plot(args.plot)
    if args.ranks is None and not args.sweep:
        raise LegionNNError("give --ranks R (or --sweep LIST)")
    machine = load_machine(args.machine)
    if args.calibrate:
        machine = load_calibrated(machine, args.calibrate)
    loaded = load_planned(args, args.network, DEFAULT_BATCH)
    verify(loaded)
    counts = _ranks_list(args.sweep) if args.sweep else [args.ranks]
    model = StepModel(machine, simulate_any_size=args.simulate)
    reports = []
    #: per report, where the command's time went (printed, not in the JSON, which stays the
    #: same from run to run): choosing the plan, then predicting its step and memory
    timings: list[tuple[float, float]] = []
    for nranks in counts:
        check_ranks(nranks)
        started = time.perf_counter()
        with model.looking_ahead():  # idle cores: the built-ins while auto searches, then memory
            graph, strategy, why, search = resolve_step(
                args, loaded, nranks, machine, model, _note, args.time_limit
            )
            plan = model.plan(graph, strategy, nranks)
            planned = time.perf_counter()
            if args.verify:
                verify_plan(graph, plan)
            predicting = time.perf_counter()
            cost, step, memory = model.predictions(graph, plan)
            predicted = time.perf_counter()
        report = report_json(graph, plan, cost, why, step, memory)
        timings.append((planned - started, predicted - predicting))
        if search is not None:
            report["pipeline_search"] = [c.row() for c in search.tried]
        reports.append(report)
    if args.sweep:
        sys.stdout.write(sweep_table(reports))
        payload = {"sweep": reports}
        if args.plot:
            from visualize.sweep import sweep_figure

            write_figure(sweep_figure(reports), args.plot, dpi=120)
    else:
        sys.stdout.write(table(reports[0]))
        planning, predicting = timings[0]
        sys.stdout.write(
            f"planned in {planning:.2f} s; its step and memory predicted in {predicting:.2f} s\n"
        )
        payload = reports[0]
        if args.plot:
            from visualize.partition_map import partition_map_figure, partition_maps

            title = (
                f"{graph.network}, batch {graph.batch}: strategy {plan.label} on "
                f"{plan.nranks} ranks"
            )
            write_figure(partition_map_figure(partition_maps(graph, plan), title), args.plot)
    if args.json:
        write_text(args.json, json.dumps(payload, indent=1) + "\n")
    return 0
