"""`legion-nn bench kernels|step|scaling|machine`: benchmarks, not tests.

- `kernels`: filter kernel throughput beside the machine's SGEMM, NumPy and PyTorch;
- `step [NETWORK] [--batch B]`: one training step of NETWORK (default seed-lcn, batch 64) against
  its roofline, task by task, beside its PyTorch peer (`bench.step`);
- `scaling`: training steps under `mpiexec` on 1, 2 and 4 ranks for each strategy, measured
  beside the cost model's calibrated prediction (see `bench.scaling`); with `--hosts H
  --link RATE[,RATE...]`, on an emulated cluster, predicted from the machine file `bench machine`
  measured there (`bench.cluster_scaling`), for the built-in strategies or `--strategies` (names
  and strategy files of grids); with `--matrix F|default`, on every variant of the cluster a
  matrix names, with each case's error, their mean and whether the strategies' order held;
- `machine`: run under `mpiexec` or `legion-nn cluster run`, it measures the machine file a plan
  is costed on (`bench.machine`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from legion_nn.errors import LegionNNError

NAME = "bench"
HELP = (
    "benchmarks: kernel GFLOP/s beside SGEMM and peers; distributed step time vs the model; "
    "the machine file"
)
SUITES = ("kernels", "step", "scaling", "machine")
KERNEL_BATCHES = [64, 256]
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
    parser.add_argument(
        "step_network",
        nargs="?",
        metavar="NETWORK",
        help="step: the network whose training step is measured (default: seed-lcn)",
    )
    parser.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    parser.add_argument(
        "--batch",
        metavar="N",
        type=_positive,
        nargs="+",
        default=None,
        help="batch sizes (kernels, default: 64 256); machine: the network's batch (default: 64); "
        "scaling --hosts: the batch of --network",
    )
    parser.add_argument(
        "--network",
        metavar="NET",
        help="machine: the network whose pieces are timed (default: seed-lcn-small); scaling "
        "--hosts: the one network to run (default: seed-lcn-small at batch 64 and seed-lcn at 16)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="machine: fewer ping-pong sizes and repeats, micro-batch counts and traced steps "
        "(for tests)",
    )
    parser.add_argument(
        "--eviction",
        metavar="E",
        help="machine: how each timed run of a piece finds the caches: write (twice the "
        "last-level cache overwritten, the default, which the cost model's factor was checked "
        "with), flush (the piece's operands' lines flushed: far quicker where the last-level "
        "cache is large, small pieces read faster) or none (warm)",
    )
    parser.add_argument(
        "--hosts",
        metavar="H",
        type=_positive,
        help="scaling: run on an emulated cluster of H hosts (needs root and iproute2)",
    )
    parser.add_argument(
        "--link",
        metavar="RATE[,RATE...]",
        help="scaling --hosts: each host's link, e.g. 1gbit or 250mbit,1gbit,3gbit for a sweep",
    )
    parser.add_argument(
        "--matrix",
        metavar="F|default",
        help="scaling --hosts: a matrix of cluster variants and cases, a JSON file "
        '{"variants": [{"name", "shaping", "burst", "offload", "cores_per_host", '
        '"ranks_per_host", "link"}], "cases": [{"network", "batch", "link"}], "strategies"}, '
        "or default: 4 variants (tbf at both ends; egress-only with 256 KiB bursts and "
        "offloads; unshaped; 2 ranks per host) of seed-lcn-small, seed-lcn and deep-mlp",
    )
    parser.add_argument(
        "--ranks",
        metavar="R",
        type=_positive,
        help="scaling --hosts: ranks across the hosts (default: one per host)",
    )
    parser.add_argument(
        "--strategies",
        metavar="S[,S...]",
        help="scaling --hosts: the strategies to run, built-ins (data, model, spatial, auto) and/or "
        'strategy files {"grids": {unit: [..]}} as partition --strategy takes them, a file\'s rows '
        "labelled by its stem, each perhaps followed by +sharded (--param-homes sharded) and "
        "+Sstages (--stages S) (default: data,model,spatial,auto)",
    )
    parser.add_argument(
        "--plot",
        metavar="F",
        help="scaling --hosts: write the step time against link bandwidth figure to F (png, svg, pdf)",
    )
    parser.add_argument(
        "--repeat",
        metavar="R",
        type=_positive,
        default=3,
        help="timed calls of ours per measurement, best kept (kernels; scaling --hosts: runs of "
        "each job, round-robin) (default: 3)",
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
        default=10,
        help="scaling: the fewest training steps per job, the first 2 untimed; a job gets more where "
        "its timed steps would take under 1 s or number under 8 (default: 10)",
    )


def run(args: argparse.Namespace) -> int:
    from bench.kernels import format_table, run_benchmark

    if args.json is not None:
        # fail before minutes of measuring, not after
        parent = Path(args.json).parent
        if not args.json or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise LegionNNError(f"--json: cannot write {args.json!r}")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say = None if args.quiet else progress
    if args.step_network is not None and args.suite != "step":
        raise LegionNNError(f"a NETWORK after the suite is for bench step, not bench {args.suite}")
    if args.suite == "step":
        return _step(args, say)
    if args.suite == "machine":
        return _machine(args, say)
    if args.eviction is not None:
        raise LegionNNError(f"--eviction is for bench machine, not bench {args.suite}")
    if args.suite == "scaling" and args.hosts is not None:
        return _cluster_scaling(args, say)
    for flag, value in (("--hosts", args.hosts), ("--link", args.link), ("--ranks", args.ranks),
                        ("--matrix", args.matrix),
                        ("--plot", args.plot), ("--network", args.network),
                        ("--strategies", args.strategies)):  # fmt: skip
        if value is not None:
            needs = "--hosts" if flag != "--hosts" else "scaling"
            raise LegionNNError(f"{flag} is for bench scaling --hosts, not bench {args.suite}"
                                if flag != "--network" else
                                f"--network is for bench machine or scaling --hosts ({needs})")  # fmt: skip
    if args.suite == "scaling":
        from bench import scaling as bench_scaling

        if args.steps <= bench_scaling.WARMUP:
            raise LegionNNError(f"--steps must exceed the {bench_scaling.WARMUP} untimed steps")
        report = bench_scaling.run_scaling(
            steps=args.steps, progress=None if args.quiet else progress
        )
        _emit(args, report, bench_scaling.format_table(report))
        return 0

    report = run_benchmark(
        batches=tuple(args.batch or KERNEL_BATCHES),
        repeat=args.repeat,
        peer_repeat=args.peer_repeat,
        rounds=args.rounds,
        impls=tuple(dict.fromkeys(args.impl)),
        progress=None if args.quiet else progress,
    )
    _emit(args, report, format_table(report) + "\n")
    return 0


def _emit(args: argparse.Namespace, report: dict, table: str) -> None:
    """Print `table` under the machine's facts and write `report` with them to `--json`: a
    figure is read on other machines than the one that measured it."""
    from bench.machine_facts import describe, machine_facts
    from legion_nn.atomic import write_text

    report.setdefault("machine", machine_facts())
    if not table.startswith("machine: "):
        print(describe(report["machine"]))
    print(table, end="")
    if args.json:
        write_text(args.json, json.dumps(report, indent=1) + "\n")


def _single_batch(args: argparse.Namespace, default: int) -> int:
    if args.batch is None:
        return default
    if len(args.batch) != 1:
        raise LegionNNError(
            f"--batch: bench {args.suite} takes one batch size, got {len(args.batch)}"
        )
    return args.batch[0]


def _step(args: argparse.Namespace, say) -> int:
    from bench import step as bench_step
    from legion_nn.networks import load_network

    network = args.step_network or "seed-lcn"
    load_network(network)  # a bad name fails before the ceilings are measured
    report = bench_step.run_step_benchmark(network, _single_batch(args, 64), say)
    _emit(args, report, bench_step.format_table(report))
    return 0


def _machine(args: argparse.Namespace, say) -> int:
    from bench import machine as machine_bench
    from bench.cache_eviction import evicting
    from legion_nn.atomic import write_text
    from legion_nn.networks import load_network

    network = args.network or "seed-lcn-small"
    load_network(network)  # a bad name fails before the ping-pongs
    batch = _single_batch(args, 64)
    with evicting(args.eviction or "write"):  # a bad one fails before the ping-pongs
        machine = machine_bench.measure(network, batch, quick=args.quick, progress=say)
    if machine is None:  # not rank 0
        return 0
    from bench.machine_facts import describe, machine_facts

    print(describe(machine_facts()))  # beside the file, not in it: its format is the contract
    print(machine_bench.format_summary(machine), end="")
    if args.json:
        write_text(args.json, json.dumps(machine, indent=1) + "\n")
    return 0


def _cluster_scaling(args: argparse.Namespace, say) -> int:
    from bench import cluster_matrix
    from bench import cluster_scaling as bench_cluster
    from bench.cluster_report import format_table as format_cluster_table
    from runtime import cluster, cluster_links
    from visualize.render_file import check_plot, write_figure

    if (args.link is None) == (args.matrix is None):
        raise LegionNNError("bench scaling --hosts needs --link RATE[,RATE...] or --matrix F")
    if args.plot is not None:
        check_plot(args.plot)
    strategies = bench_cluster.STRATEGIES
    if args.matrix is not None:
        for flag, value in (("--network", args.network), ("--batch", args.batch)):
            if value is not None:
                raise LegionNNError(f"{flag}: a matrix names its cases (--matrix)")
        variants, cases, listed = cluster_matrix.read_matrix(args.matrix)
        if listed is not None and args.strategies is None:
            strategies = bench_cluster.parse_strategies(",".join(listed))
    else:
        links = [link.strip() for link in args.link.split(",") if link.strip()]
        for link in links:
            cluster_links.parse_rate(link)
        if args.network is not None:
            from legion_nn.networks import load_network

            load_network(args.network)
            pairs = ((args.network, _single_batch(args, 64)),)
        else:
            if args.batch is not None:
                raise LegionNNError("--batch with scaling --hosts needs --network")
            pairs = bench_cluster.DEFAULT_CASES
        variants, cases = cluster_matrix.link_sweep(links, pairs)
    if args.strategies is not None:
        strategies = bench_cluster.parse_strategies(args.strategies)
        bench_cluster.check_strategies(
            [(c.network, c.batch) for c in cases], args.ranks or args.hosts, strategies
        )
    cluster.require()
    try:
        report = bench_cluster.run_cluster_scaling(
            args.hosts,
            variants,
            cases,
            strategies,
            args.ranks,
            steps=args.steps,
            repeat=args.repeat,
            progress=say,
        )
    except cluster.Terminated:  # its clusters and files are gone: nothing more to say
        return 128 + signal.SIGTERM
    _emit(args, report, format_cluster_table(report))
    if args.plot:
        from visualize.link_sweep import link_sweep_figure

        write_figure(link_sweep_figure(report), args.plot)
    return 0
