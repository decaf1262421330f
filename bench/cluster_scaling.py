"""`legion-nn bench scaling --hosts H --link RATE[,RATE...]`: the cost model on an emulated cluster.

For each link rate an emulated cluster of H hosts is brought up (`runtime.cluster`), and for each
network (at its batch):

1. `legion-nn bench machine` runs on the cluster (one `mpiexec` job, R ranks across the hosts) and
   writes the machine file: the link between hosts and within one, the runtime's kernels on the
   network's pieces, its per-task overhead, memory bandwidth, cores and memory per rank;
2. each strategy's step is predicted from that file alone, as `legion-nn partition --machine F`
   predicts it (`auto` is the plan the search picks on that machine), and so is one rank's on one
   host (the "one host" row, measured once per network: it has no link), the step data
   parallelism must beat to pay;
3. each strategy's step is measured: `legion-nn train --strategy S` (auto with `--machine F`) on
   the same cluster, timed as `bench scaling` times its jobs (`best_jobs`: at least a second of
   steps, the best of `repeat` runs taken round-robin, a step being its slowest rank's).

A strategy is a built-in's name (`data`, `model`, `spatial`, `auto`) or a strategy file of grids,
`{"grids": {unit: [parts, ...]}}` (`--strategies data,rows.json`): the file is read and resolved
by `partitioner.resolve`, as `partition --strategy FILE` and `train --strategy FILE` resolve it,
and its rows are labelled by the file's stem (`rows` for `rows.json`). A `+sharded` after either
(`data+sharded`) runs and predicts it with `--param-homes sharded`.

The rows give both, their error, the bytes a step sends and which plan auto chose; the plot puts
step time against the link's bandwidth, one colour per strategy, predicted lines and measured
points, so that it shows where data parallelism stops paying.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.jobs import OPTIMIZER, WARMUP, best_jobs
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine, load_machine
from partitioner.plan import build_plan
from partitioner.resolve import check_strategy_name, read_grids, resolve_strategy
from partitioner.strategy import STRATEGY_NAMES
from runtime import cluster
from runtime.step_simulator import step_prediction

DEFAULT_CASES = (("seed-lcn-small", 64), ("seed-lcn", 16))
STRATEGIES = STRATEGY_NAMES
#: the row of one rank on one host: the step data parallelism must beat to pay
ONE_HOST = "one host"
#: auto's search on the benchmark's machine: the same limit `train` gives it
SEARCH_SECONDS = 30.0


#: after a strategy, `--param-homes sharded`
SHARDED = "+sharded"


def split_homes(strategy: str) -> tuple[str, str | None]:
    """(`--strategy`, `--param-homes` or None) of a strategy as `--strategies` gives it."""
    if strategy.endswith(SHARDED):
        return strategy.removesuffix(SHARDED), "sharded"
    return strategy, None


def strategy_label(strategy: str) -> str:
    """A strategy's name in the rows: a built-in's own, a strategy file's stem; `+sharded`
    after either."""
    name, homes = split_homes(strategy)
    label = name if name in STRATEGY_NAMES else Path(name).stem
    return label + (SHARDED if homes else "")


def _train_arguments(strategy: str) -> list[str]:
    homes = split_homes(strategy)[1]
    return ["--param-homes", homes] if homes else []


def parse_strategies(text: str) -> list[str]:
    """`--strategies data,model,rows.json`: built-ins' names and strategy files, in order, each
    file as an absolute path (the jobs run `train` from the hosts); a name that is neither, a
    file that is missing or not a strategy file, or two with one label (`a/rows.json` and
    `b/rows.json`, or a file `data.json`) is one line."""
    strategies = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, homes = split_homes(item)
        try:
            check_strategy_name(name)
        except LegionNNError as exc:
            raise LegionNNError(f"--strategies: {str(exc).removeprefix('--strategy: ')}") from None
        if name not in STRATEGY_NAMES:
            read_grids(name)  # a missing or malformed file fails here, before any cluster
            name = str(Path(name).resolve())
        strategies.append(name + (SHARDED if homes else ""))
    if not strategies:
        raise LegionNNError(f"--strategies: no strategy in {text!r}")
    labels = [strategy_label(s) for s in strategies]
    for label in labels:
        if labels.count(label) > 1 or label == ONE_HOST:
            raise LegionNNError(
                f"--strategies: two strategies would share the label {label!r} in the table"
                if label != ONE_HOST
                else f"--strategies: {label!r} names the one-host row"
            )
    return strategies


def check_strategies(
    cases: Sequence[tuple[str, int]], ranks: int, strategies: Sequence[str]
) -> None:
    """Each strategy file's grids fit each network on `ranks` ranks (`partition --strategy FILE`
    would take them): checked before any cluster comes up, not after minutes of measuring."""
    files = [split_homes(s)[0] for s in strategies if split_homes(s)[0] not in STRATEGY_NAMES]
    for network, batch in cases if files else ():
        graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
        for path in files:
            resolve_strategy(graph, path, ranks, Machine(), SEARCH_SECONDS)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "legion_nn.cli", *args]


def measure_machine(name: str, ranks: int, network: str, batch: int, path: Path) -> Machine:
    """`legion-nn bench machine` on cluster `name`; the machine file it wrote."""
    command = _cli(
        "cluster", "run", "--on", name, "-n", str(ranks), "--",
        *_cli("bench", "machine", "--network", network, "--batch", str(batch),
              "--json", str(path)),
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise LegionNNError(f"bench scaling: bench machine on cluster {name} failed: {last}")
    return load_machine(str(path))


def predict(network: str, batch: int, ranks: int, strategy: str, machine: Machine) -> dict:
    """The step `partition --machine` predicts (simulated), its bulk-synchronous sum, and for
    auto the families it chose; `strategy` is what `partition --strategy` takes (a built-in,
    auto or a strategy file), resolved as it resolves it."""
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    name, homes = split_homes(strategy)
    plan_strategy, why = resolve_strategy(
        graph, name, ranks, machine, SEARCH_SECONDS, param_homes=homes
    )
    chosen = ",".join(sorted({c["family"] for c in why})) if why else ""
    plan = build_plan(graph, plan_strategy, ranks)
    cost = plan_cost(graph, plan, machine)
    step = step_prediction(graph, plan, machine, cost.step_seconds)
    return {
        "predicted_s": step["predicted_step_seconds"],
        "bulk_synchronous_s": step["bulk_synchronous_seconds"],
        "bytes_planned": cost.bytes_sent,
        "auto_chose": chosen,
    }


def run_cluster_scaling(
    hosts: int,
    links: Sequence[str],
    ranks: int | None = None,
    cases: Sequence[tuple[str, int]] = DEFAULT_CASES,
    strategies: Sequence[str] = STRATEGIES,
    steps: int = 8,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    say = progress or (lambda line: None)
    ranks = ranks or hosts
    check_strategies(cases, ranks, strategies)
    rates = [(link, cluster.parse_rate(link)) for link in links]
    rows, machines = [], []
    one_host: dict[tuple[str, int], object] = {}
    name = f"s{os.getpid() % 10_000_000}"
    with tempfile.TemporaryDirectory(prefix="legion-nn-cluster-scaling-") as tmp:
        for link, bits in rates:
            say(f"cluster {name}: {hosts} hosts, link {link}")
            made = cluster.up(name, hosts, bits)
            try:
                launch = _cli("cluster", "run", "--on", name, "-n", str(ranks), "--")
                for case, (network, batch) in enumerate(cases):
                    # a network may be a spec file's path
                    where = Path(tmp) / f"{link}-{case}-{Path(network).stem}"
                    where.mkdir()
                    say(f"{network} batch {batch}: bench machine on {ranks} ranks")
                    machine_file = where / "machine.json"
                    machine = measure_machine(made.name, ranks, network, batch, machine_file)
                    machines.append(
                        {"link": link, "network": network, "batch": batch}
                        | json.loads(machine_file.read_text())
                    )
                    specs = [
                        {
                            "network": network, "batch": batch, "ranks": ranks,
                            "strategy": split_homes(strategy)[0], "steps": steps,
                            "launch": launch,
                            "extra": (["--machine", str(machine_file)]
                                      if split_homes(strategy)[0] == "auto" else [])
                            + _train_arguments(strategy),
                        }
                        for strategy in strategies
                    ]  # fmt: skip
                    labels = [strategy_label(s) for s in strategies]
                    named = dict(zip(labels, strategies))
                    if (network, batch) not in one_host:
                        # no link in it: measured once, on the first cluster
                        labels.append(ONE_HOST)
                        specs.append(
                            {"network": network, "batch": batch, "ranks": 1, "strategy": "data",
                             "steps": steps, "launch": _cli("cluster", "run", "--on", name,
                                                            "-n", "1", "--")}
                        )  # fmt: skip
                    jobs = best_jobs(specs, repeat, where / "jobs", say)
                    if ONE_HOST in labels:
                        one_host[network, batch] = jobs[-1]
                    else:
                        labels.append(ONE_HOST)
                        jobs.append(one_host[network, batch])
                    for label, job in zip(labels, jobs):
                        count = 1 if label == ONE_HOST else ranks
                        strategy = "data" if label == ONE_HOST else named[label]
                        row = {
                            "link": link, "link_bits": bits, "network": network,
                            "batch": batch, "hosts": hosts, "ranks": count,
                            "strategy": label,
                        }  # fmt: skip
                        if split_homes(strategy)[0] not in STRATEGY_NAMES:
                            row["strategy_file"] = split_homes(strategy)[0]
                        if isinstance(job, LegionNNError):
                            rows.append(row | {"failed": str(job).split(": ", 2)[-1]})
                            continue
                        predicted = predict(network, batch, count, strategy, machine)
                        rows.append(
                            row
                            | predicted
                            | {
                                "measured_s": job.step_seconds,
                                "error": predicted["predicted_s"] / job.step_seconds - 1.0,
                                "bytes_per_step": job.bytes_per_step,
                            }
                        )
            finally:
                cluster.down(name)
    return {
        "hosts": hosts,
        "ranks": ranks,
        "links": list(links),
        "min_steps": steps,
        "warmup": WARMUP,
        "repeat": repeat,
        "machines": machines,
        "results": rows,
    }


def format_table(report: dict) -> str:
    # a strategy file's stem, or a network's spec file, may be longer than the built-ins' names
    width = max([8, *(len(row["strategy"]) for row in report["results"])])
    wide = max([16, *(len(row["network"]) for row in report["results"])])
    lines = [
        f"{report['hosts']} emulated hosts, {report['ranks']} ranks",
        (
            f"{'link':>9s} {'network':{wide}s} {'batch':>5s} {'strategy':{width}s} "
            f"{'measured':>10s} {'predicted':>10s} {'error':>7s} {'bytes/step':>14s}  auto chose"
        ),
    ]
    for row in report["results"]:
        head = (
            f"{row['link']:>9s} {row['network']:{wide}s} {row['batch']:5d} "
            f"{row['strategy']:{width}s}"
        )
        if "failed" in row:
            lines.append(f"{head} failed: {row['failed']}")
            continue
        lines.append(
            f"{head} {row['measured_s']:9.4f}s {row['predicted_s']:9.4f}s {row['error']:+7.1%} "
            f"{row['bytes_per_step']:14,d}  {row['auto_chose']}"
        )
    for network in dict.fromkeys(r["network"] for r in report["results"]):
        for link in report["links"]:
            done = [
                r
                for r in report["results"]
                if r["network"] == network and r["link"] == link and "measured_s" in r
            ]
            fixed = [r for r in done if r["strategy"] not in ("auto", ONE_HOST)]
            chosen = [r for r in done if r["strategy"] == "auto"]
            if fixed and chosen:
                best = min(fixed, key=lambda r: r["measured_s"])
                ratio = chosen[0]["measured_s"] / best["measured_s"] - 1.0
                lines.append(
                    f"{network} at {link}: auto {ratio:+.1%} against the best measured "
                    f"({best['strategy']})"
                )
    return "\n".join(lines) + "\n"
