"""`legion-nn bench scaling --hosts H --link RATE[,RATE...] | --matrix F|default`: the cost model
on emulated clusters.

For each variant of the cluster (each link rate of `--link`; or each variant of a matrix: its
shaping, burst, offloads, cores and ranks per host, `cluster_matrix.read_matrix`) an emulated
cluster of H hosts is brought up (`runtime.cluster`), and for each network (at its batch, on its
link):

1. `legion-nn bench machine` runs on the cluster (one `mpiexec` job, R ranks across the hosts) and
   writes the machine file: the link between hosts and within one, the runtime's kernels on the
   network's pieces, its per-task overhead, memory bandwidth, cores and memory per rank;
2. each strategy's step is predicted from that file alone, as `legion-nn partition --machine F`
   predicts it (`auto` is the plan the search picks on that machine), and so is one rank's on one
   host (the "one host" row, measured on each variant beside the file whose calibration it
   checks), the step data parallelism must beat to pay;
3. each strategy's step is measured: `legion-nn train --strategy S --no-evaluation` (auto with
   `--machine F`) on the same cluster, timed as `bench scaling` times its jobs (`best_jobs`: at
   least a second of steps, the best of `repeat` runs taken round-robin, a step being its
   slowest rank's).

A strategy is a built-in's name (`data`, `model`, `spatial`, `auto`) or a strategy file of grids,
`{"grids": {unit: [parts, ...]}}` (`--strategies data,rows.json`): the file is read and resolved
by `partitioner.resolve`, as `partition --strategy FILE` and `train --strategy FILE` resolve it,
and its rows are labelled by the file's stem (`rows` for `rows.json`). A `+sharded` after either
(`data+sharded`) runs and predicts it with `--param-homes sharded`, and a last `+Sstages`
(`data+2stages`) in a pipeline of S stages with 2·S micro-batches (`partitioner.pipeline`), or
`+autostages` in the stages, micro-batches and cuts `--stages auto` chooses; `-deferred` after
either (`model+2stages-deferred`) under `--schedule 1f1b-deferred`.

The rows give both, their error, how far the job's runs lay apart (`cluster_report.run_spread`:
the machine's noise for that job), the share of a step a rank computes (measured from the log's
`compute_seconds`, the kernels' time, against the simulation's: where a prediction misses, this
says whether the kernels or the waits did), the bytes a step sends and which plan auto chose;
the summary the mean and largest absolute error, and per case whether the measured order of
the strategies was predicted and how far auto's measured step is from the best
(`bench.cluster_report`); the plot puts step time against the link's bandwidth, one colour per strategy, predicted lines and
measured points, so that it shows where data parallelism stops paying.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from bench.cluster_matrix import Case, Variant
from bench.cluster_report import ONE_HOST, summarize
from bench.jobs import MIN_TIMED_STEPS, OPTIMIZER, WARMUP, best_jobs, failure_line
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.machine_file import load_machine
from partitioner.pipeline import pipelined
from partitioner.resolve import resolve_stages, resolve_strategy
from partitioner.search.stages import AUTO_STAGES
from partitioner.strategy import STRATEGY_NAMES
from partitioner.strategy_file import check_strategy_name, read_grids
from runtime import cluster, cluster_links
from runtime.step.model import StepModel

DEFAULT_CASES = (("seed-lcn-small", 64), ("seed-lcn", 16))
STRATEGIES = STRATEGY_NAMES
#: the keys each saved machine file of a run is given, naming its case (`bench/repredict.py`)
CASE_KEYS = ("variant", "link", "network", "batch")
#: auto's search on the benchmark's machine: the same limit `train` gives it
SEARCH_SECONDS = 30.0


#: after a strategy, `--param-homes sharded`
SHARDED = "+sharded"
#: last after a strategy, `+2stages`: `--stages 2` (with `--micro-batches` at its default, 2·S);
#: `+autostages`: `--stages auto`; either with `-deferred` after it: `--schedule 1f1b-deferred`
STAGES = re.compile(r"\+(\d+|auto)stages(-deferred)?$")
#: the schedule of a pipeline as `--strategies` names it, without and with `-deferred`
PIPELINE_SCHEDULES = ("1f1b", "1f1b-deferred")


def split_stages(strategy: str) -> tuple[str, int | str]:
    """(the strategy without its stages, `--stages`) of a strategy as `--strategies` gives it."""
    found = STAGES.search(strategy)
    if found is None:
        return strategy, 1
    count = found.group(1)
    return strategy[: found.start()], count if count == AUTO_STAGES else int(count)


def stage_schedule(strategy: str) -> str | None:
    """`--schedule` of a strategy as `--strategies` gives it (`STAGES`): None for `+autostages`
    (`--stages auto` chooses it)."""
    found = STAGES.search(strategy)
    if found and found.group(2):
        return PIPELINE_SCHEDULES[1]
    return None if found and found.group(1) == AUTO_STAGES else PIPELINE_SCHEDULES[0]


def split_homes(strategy: str) -> tuple[str, str | None]:
    """(`--strategy`, `--param-homes` or None) of a strategy as `--strategies` gives it."""
    strategy = split_stages(strategy)[0]
    if strategy.endswith(SHARDED):
        return strategy.removesuffix(SHARDED), "sharded"
    return strategy, None


def _suffix(strategy: str) -> str:
    homes, stages = split_homes(strategy)[1], split_stages(strategy)[1]
    deferred = "-deferred" if stage_schedule(strategy) == PIPELINE_SCHEDULES[1] else ""
    return (SHARDED if homes else "") + (f"+{stages}stages{deferred}" if stages != 1 else "")


def strategy_label(strategy: str) -> str:
    """A strategy's name in the rows: a built-in's own, a strategy file's stem; `+sharded` and
    `+Sstages` after either."""
    name = split_homes(strategy)[0]
    label = name if name in STRATEGY_NAMES else Path(name).stem
    return label + _suffix(strategy)


def _train_arguments(strategy: str) -> list[str]:
    homes, stages = split_homes(strategy)[1], split_stages(strategy)[1]
    schedule = stage_schedule(strategy)
    return (
        (["--param-homes", homes] if homes else [])
        + (["--stages", str(stages)] if stages != 1 else [])
        + (["--schedule", schedule] if schedule == PIPELINE_SCHEDULES[1] else [])
    )


def parse_strategies(text: str) -> list[str]:
    """`--strategies data,model,rows.json`: built-ins' names and strategy files, in order, each
    file as an absolute path (the jobs run `train` from the hosts); a name that is neither, a
    file that is missing or not a strategy file, or two with one label (`a/rows.json` and
    `b/rows.json`, or a file `data.json`) is one line."""
    strategies = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name = split_homes(item)[0]
        try:
            check_strategy_name(name)
        except LegionNNError as exc:
            raise LegionNNError(f"--strategies: {str(exc).removeprefix('--strategy: ')}") from None
        if name not in STRATEGY_NAMES:
            read_grids(name)  # a missing or malformed file fails here, before any cluster
            name = str(Path(name).resolve())
        strategies.append(name + _suffix(item))
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
    return [sys.executable, "-m", "cli", *args]


def measure_machine(name: str, ranks: int, network: str, batch: int, path: Path) -> Machine:
    """`legion-nn bench machine` on cluster `name`; the machine file it wrote."""
    command = _cli(
        "cluster", "run", "--on", name, "-n", str(ranks), "--",
        *_cli("bench", "machine", "--network", network, "--batch", str(batch),
              "--json", str(path)),
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        raise LegionNNError(
            f"bench scaling: bench machine on cluster {name} failed: {failure_line(result.stderr)}"
        )
    return load_machine(str(path))


def predict(network: str, batch: int, ranks: int, strategy: str, machine: Machine) -> dict:
    """The step `partition --machine` predicts (simulated), its bulk-synchronous sum, and for
    auto the families it chose; `strategy` is what `partition --strategy` takes (a built-in,
    auto or a strategy file), resolved as it resolves it."""
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    stages = split_stages(strategy)[1]
    name, homes = split_homes(strategy)
    model = StepModel(machine)
    pipeline = ""
    schedule = stage_schedule(strategy)
    if stages == AUTO_STAGES:
        graph, plan_strategy, why, search = resolve_stages(
            graph, name, ranks, machine, SEARCH_SECONDS, schedule, None, None, homes, model.peak,
            model.step, model.step_lower_bound, model.step_is_sum,
            compared=model.compared_steps,
        )  # fmt: skip
        pipeline = search.chosen.label
    else:
        if stages > 1:
            graph = pipelined(graph, stages, 2 * stages, schedule or PIPELINE_SCHEDULES[0])[0]
        plan_strategy, why = resolve_strategy(
            graph, name, ranks, machine, SEARCH_SECONDS, param_homes=homes,
            peak=model.peak, step=model.step, lower=model.step_lower_bound,
            sums=model.step_is_sum,
        )  # fmt: skip
    chosen = ",".join(sorted({c["family"] for c in why})) if why else ""
    chosen = "; ".join(part for part in (chosen, pipeline) if part)
    plan = model.plan(graph, plan_strategy, ranks)
    cost = plan_cost(graph, plan, machine)
    step = model.step_prediction(graph, plan, cost.step_seconds)
    return {
        "predicted_s": step["predicted_step_seconds"],
        "compute_fraction_predicted": step.get("compute_fraction"),
        "bulk_synchronous_s": step["bulk_synchronous_seconds"],
        "bytes_planned": cost.bytes_sent,
        "auto_chose": chosen,
    }


def run_cluster_scaling(
    hosts: int,
    variants: Sequence[Variant],
    cases: Sequence[Case],
    strategies: Sequence[str] = STRATEGIES,
    ranks: int | None = None,
    steps: int = 8,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every case on every variant of the cluster: `ranks` ranks (default: the variant's ranks
    per host on each host), the machine measured there, each strategy predicted and run."""
    say = progress or (lambda line: None)
    check_strategies([(c.network, c.batch) for c in cases], ranks or hosts, strategies)
    rows, machines = [], []
    name = f"s{os.getpid() % 10_000_000}"
    with (
        cluster.terminated_cleanly(),
        tempfile.TemporaryDirectory(prefix="legion-nn-cluster-scaling-") as tmp,
    ):
        for variant in variants:
            count = ranks or hosts * variant.ranks_per_host
            by_link: dict[str, list[Case]] = {}
            for case in cases:
                by_link.setdefault(variant.link or case.link, []).append(case)
            for link, group in by_link.items():
                bits = cluster_links.parse_rate(link)
                say(f"cluster {name} ({variant.name}): {hosts} hosts, link {link}, "
                    f"{variant.options.describe()}, {count} ranks")  # fmt: skip
                made = cluster.up(name, hosts, bits, variant.options)
                try:
                    rows += _run_cases(
                        made.name, variant, link, bits, hosts, count, group, strategies, steps,
                        repeat, Path(tmp), machines, say,
                    )  # fmt: skip
                finally:
                    cluster.down(name)
    report = {
        "hosts": hosts,
        "ranks": ranks or hosts,
        "links": list(dict.fromkeys(r["link"] for r in rows)),
        "variants": [
            {"name": v.name, "ranks_per_host": v.ranks_per_host, "link": v.link} | asdict(v.options)
            for v in variants
        ],
        "min_steps": steps,
        "min_timed_steps": MIN_TIMED_STEPS,
        "warmup": WARMUP,
        "repeat": repeat,
        "machines": machines,
        "results": rows,
    }
    report["summary"] = summarize(rows)
    return report


def _run_cases(
    name: str, variant: Variant, link: str, bits: float | None, hosts: int, ranks: int,
    cases: Sequence[Case], strategies: Sequence[str], steps: int, repeat: int, tmp: Path,
    machines: list, say: Callable[[str], None],
) -> list[dict]:  # fmt: skip
    rows = []
    launch = _cli("cluster", "run", "--on", name, "-n", str(ranks), "--")
    for case in cases:
        network, batch = case.network, case.batch
        # a network may be a spec file's path
        where = tmp / f"{variant.name}-{link}-{Path(network).stem}-{batch}"
        where.mkdir(parents=True)
        say(f"{network} batch {batch}: bench machine on {ranks} ranks")
        machine_file = where / "machine.json"
        machine = measure_machine(name, ranks, network, batch, machine_file)
        case_keys = dict(zip(CASE_KEYS, (variant.name, link, network, batch)))
        machines.append(case_keys | json.loads(machine_file.read_text()))
        specs = [
            {
                "network": network, "batch": batch, "ranks": ranks,
                "strategy": split_homes(strategy)[0], "steps": steps, "launch": launch,
                "extra": (["--machine", str(machine_file)]
                          if split_homes(strategy)[0] == "auto" else [])
                + _train_arguments(strategy),
            }
            for strategy in strategies
        ]  # fmt: skip
        labels = [strategy_label(s) for s in strategies]
        named = dict(zip(labels, strategies))
        # measured beside each variant's machine file, whose calibration it checks: measured
        # once for every variant, it read one file's calibration 41% long, 25 minutes later
        labels.append(ONE_HOST)
        specs.append(
            {"network": network, "batch": batch, "ranks": 1, "strategy": "data",
             "steps": steps, "launch": _cli("cluster", "run", "--on", name, "-n", "1", "--")}
        )  # fmt: skip
        jobs = best_jobs(specs, repeat, where / "jobs", say)
        for label, job in zip(labels, jobs):
            count = 1 if label == ONE_HOST else ranks
            strategy = "data" if label == ONE_HOST else named[label]
            row = {
                "variant": variant.name, "link": link, "link_bits": bits, "network": network,
                "batch": batch, "hosts": hosts, "ranks": count, "strategy": label,
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
                    "measured_runs_s": list(job.runs_s),
                    "error": predicted["predicted_s"] / job.step_seconds - 1.0,
                    "bytes_per_step": job.bytes_per_step,
                    "compute_fraction_measured": job.compute_fraction,
                }
            )
    return rows
