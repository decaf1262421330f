"""`legion-nn partition NETWORK --ranks R --strategy S`: plan a step on R ranks and predict it."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "partition"
HELP = "partition a network over R ranks (data, model, spatial, auto) and predict its step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("network", help="a built-in or a JSON/TOML spec file")
    parser.add_argument("--ranks", type=int, default=None, help="number of ranks R")
    parser.add_argument(
        "--strategy",
        default="auto",
        help='data, model, spatial, auto, or a JSON file {"grids": {unit: [..]}} (default auto)',
    )
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
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
    parser.add_argument("--plot", metavar="F", help="with --sweep: write a PNG of the sweep")
    parser.add_argument(
        "--time-limit", type=float, default=30.0, help="seconds auto may search (default 30)"
    )


def _strategy(graph, name: str, nranks: int, machine, time_limit: float):
    from legion_nn.errors import LegionNNError
    from partitioner.search import auto
    from partitioner.strategy import BUILTIN, builtin, from_grids

    if name == "auto":
        result = auto(graph, nranks, machine, time_limit)
        why = [
            {
                "layer": c.unit,
                "family": c.family,
                "grid": list(c.grid),
                "seconds": c.seconds,
                "data_seconds": c.data_seconds,
            }
            for c in result.choices
        ]
        return result.strategy, why
    if name in BUILTIN:
        return builtin(graph, name, nranks), None
    if not name.endswith(".json"):
        raise LegionNNError(
            f"--strategy: unknown strategy {name!r}; choose one of "
            f"{', '.join(BUILTIN + ('auto',))}, or a JSON file of grids"
        )
    try:
        with open(name) as handle:
            spec = json.load(handle)
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{name}: not JSON ({exc.msg})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("grids"), dict):
        raise LegionNNError(f'{name}: a strategy file is {{"grids": {{unit: [parts, ...]}}}}')
    try:
        return from_grids(graph, spec["grids"], nranks), None
    except LegionNNError as exc:
        raise LegionNNError(f"{name}: {exc}") from None


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
    from legion_nn.atomic import write_bytes, write_text
    from legion_nn.errors import LegionNNError
    from legion_nn.networks import load_network
    from partitioner.cost import plan_cost
    from partitioner.machine import load_calibrated, load_machine
    from partitioner.plan import build_plan
    from partitioner.report import report_json, sweep_table, table
    from partitioner.strategy import check_ranks

    if args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    if args.ranks is not None and args.ranks < 1:
        raise LegionNNError(f"--ranks must be at least 1, got {args.ranks}")
    if not args.time_limit >= 0:
        raise LegionNNError(f"--time-limit must be at least 0 seconds, got {args.time_limit}")
    if args.plot and not args.sweep:
        raise LegionNNError("--plot draws a sweep; give --sweep LIST too")
    if args.ranks is None and not args.sweep:
        raise LegionNNError("give --ranks R (or --sweep LIST)")
    machine = load_machine(args.machine)
    if args.calibrate:
        machine = load_calibrated(machine, args.calibrate)
    graph = load_network(args.network).lower(batch=args.batch)
    counts = _ranks_list(args.sweep) if args.sweep else [args.ranks]
    reports = []
    for nranks in counts:
        check_ranks(nranks)
        strategy, why = _strategy(graph, args.strategy, nranks, machine, args.time_limit)
        plan = build_plan(graph, strategy, nranks)
        reports.append(report_json(graph, plan, plan_cost(graph, plan, machine), why))
    if args.sweep:
        sys.stdout.write(sweep_table(reports))
        payload = {"sweep": reports}
        if args.plot:
            from visualize.sweep import sweep_figure

            figure = sweep_figure(reports)
            import io

            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=120)
            write_bytes(args.plot, buffer.getvalue())
    else:
        sys.stdout.write(table(reports[0]))
        payload = reports[0]
    if args.json:
        write_text(args.json, json.dumps(payload, indent=1) + "\n")
    return 0
