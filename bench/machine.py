"""`legion-nn bench machine`: measure the machine file a plan is costed on.

Run it where the job will run: under `mpiexec -n R` on a cluster, or `legion-nn cluster run
--hosts H --link RATE -n R -- legion-nn bench machine` on the emulated one. Every rank takes its
share of its host's cores, as `train` does; rank 0 measures while the others wait (sleeping, so
that the cores of a host stay with the rank measuring), and writes the file:

- the links, from ping-pongs at 8 B to 64 MiB (`mpi_transport.link_times`), each fitted as latency
  plus bytes over bandwidth (`fit_link`): rank 0 and the first rank on another host (the link
  between hosts, `latency_us` and `link_gbytes_per_s`), and rank 0 and rank 1 where they share a
  host (`intra_host`); between hosts also the rate each way with both directions at once,
  fitted the same way (`duplex_gbytes_per_s`: a link whose hosts' cores move the bytes is not
  full duplex, `Machine.stack_beta`), and the burst an idle link lets through at once
  (`link_burst_bytes`, `fit_burst`: a token bucket's, a NIC's or a switch's buffer);
- the layout: hosts, ranks per host (ranks are placed in blocks), the cores a rank has and its
  share of its host's memory (`rank_memory_gib`);
- compute on the named network's shapes: every distinct piece of its data, model and spatial
  plans, on 1 rank and on R (with parameters replicated and sharded: a sharded plan updates
  its shards in tasks of their own, which the FLOP model priced at the one-rank step's rate for
  updates fused into their gradients' kernels, 0.035 GFLOP/s: seed-lcn-small's sharded data
  plan on 2 ranks 10.6 ms of compute a rank against 6.2 ms replicated), and of micro-batches
  on a rank of their own (one process's 2, 4 and 8, and a pipeline of R stages streaming R,
  2·R and 4·R: a one-rank step at the micro-batch's rows,
  `bench.traced_steps.micro_batch_counts`), under every optimizer (their update tasks differ),
  timed with the runtime's kernels on the rank's thread count (`bench.task_profile`,
  FlexFlow's per-configuration measurement) into the `pieces` table; the pieces only
  micro-batches run are then read from traced one-rank steps in micro-batches
  (`bench.traced_steps.micro_batch_pieces_in_step`), where each adds into a weight-sized
  gradient out of the caches;
  micro-batches are timed under both `MICRO_SCHEDULES` where the network has weight gradients
  to defer;
- the runtime's costs outside its kernels, from a traced one-rank training of the network in
  this process (`bench.calibration.calibrate`): per-task overhead, the factor by which a kernel in a
  step is slower than alone, the step's time outside its tasks (`loop_us`), the bandwidth its
  memory-bound tasks reach, and each op's rate for pieces the table lacks (`op_gflops`);
- what a message costs a rank beyond its link (`bench.message_costs`): the runtime's cost per
  message (`message_overhead_us`): every rank runs a job that is mostly
  messages, `MESSAGE_JOB` (a small network cut by channels over all ranks, its pieces timed
  first), and the cost is what makes the simulated step (`runtime.step.simulator`) equal the
  measured one: each rank's bookkeeping and MPI calls per message, beyond the link's latency
  (the median of `MESSAGE_ROUNDS` runs, each fit and each run's measured and one-rank steps
  in `measured_on`);
- what the network stack costs a rank's kernels per byte it sends or receives between hosts
  (`network_cpu_ns_per_byte`), and how fast those bytes cross while the kernel runs
  (`computing_gbytes_per_s` into the kernel's rank and `computing_send_gbytes_per_s` out of
  it, where slower than the link): a kernel timed alone, and with a stream each way beside it,
  whose messages done when the kernel ends are counted (the simulators hold a kernel's
  transfers to those rates and have it share its core with their bytes);
- what a rank's process holds besides its buffers (`process_baseline_mib`: the interpreter,
  NumPy, Numba's compiled kernels, the allocator's slack), from a fresh one-process training of
  the network: its peak resident set less its buffers' peak, as `train --log-json` records them.

`partition --machine F`, `render --machine F` and `train --strategy auto --machine F` read it
(`partitioner.machine_file`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from bench import cache_eviction
from bench.calibration import buffer_pass_rates, calibrate, memory_bandwidth
from bench.jobs import MIN_TIMED_S, OPTIMIZER, failure_line
from bench.message_costs import (
    MESSAGE_JOB,
    MESSAGE_ROUNDS,
    QUICK_MESSAGE_ROUNDS,
    message_overhead_us,
    network_stack_costs,
)
from bench.task_profile import profile_as_run, profile_plan, sample_step
from bench.traced_steps import (
    CALIBRATION_STEPS,
    MICRO_SCHEDULES,
    QUICK_MICRO_STEPS,
    micro_batch_counts,
    micro_batch_pieces_in_step,
    traced_training,
)
from legion_nn.errors import LegionNNError
from legion_nn.lowering import OPTIMIZERS
from legion_nn.micro_batches import defers_weight_grads, micro_batched
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import BUILTIN, PARAM_HOMES, builtin, with_homes
from runtime.launch import host_cores, world_size_from_env

#: up to 256 MiB: a gradient's hop is often tens or hundreds of MB (seed-lcn's classifier on
#: 2-4 ranks: 142-283 MB), and a software link's rate falls with size (a veth pair between
#: namespaces: 2.8 GB/s at 1 MiB, 0.65 at 64 MiB; with two ranks a host, exchanges at 0.41-0.42
#: GB/s each way up to 64 MiB and 0.35 at 256 MiB), so the fitted slope and the exchanges'
#: times must see messages that large
LINK_SIZES = (8, 1024, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
#: `--quick`'s: the slopes (the link's and both ways at once) fitted over 1-4 MiB, since over 1-2
#: MiB a 2 ms wobble in one median moved a 400 Mbit/s link's duplex rate 15% past the link's
QUICK_LINK_SIZES = (8, 1024, 65536, 1 << 20, 2 << 20, 4 << 20)
STRATEGIES = BUILTIN
#: passes over the plans' pieces, each timing every piece (`measure_compute`)
PROFILE_PASSES = 3
#: the most steps the calibration's traced training runs (`calibrate_in_process`)
MAX_CALIBRATION_STEPS = 1000


def _host_memory_gib() -> float:
    """This host's memory, or the cgroup's limit where that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    try:
        text = limit.read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total / 2**30


def _layout(hosts: list[str]) -> tuple[int, int]:
    """(host count, ranks per host) of ranks placed in blocks, host by host."""
    names = list(dict.fromkeys(hosts))
    per_host = hosts.count(names[0])
    expected = [name for i, name in enumerate(names) for _ in range(per_host)][: len(hosts)]
    if hosts != expected:
        raise LegionNNError(
            "bench machine: ranks are not placed in blocks host by host "
            f"({', '.join(hosts)}); the cost model places them so"
        )
    return len(names), per_host


def calibrate_in_process(network: str, batch: int, threads: int, profiled: dict) -> dict:
    """Fit the runtime's per-task costs to a traced one-rank training run in this process:
    `CALIBRATION_STEPS` steps, or as many as the profiled step takes to fill `MIN_TIMED_S`,
    the least a measured job times. 12 steps of seed-lcn-small at batch 64 are 90 ms, which
    one slow stretch of the VM fills: its file's calibration then read the step 31% long."""
    step = sum(profiled.values())
    steps = max(CALIBRATION_STEPS, math.ceil(MIN_TIMED_S / step) if step > 0 else 0)
    job = traced_training(network, batch, steps=min(steps, MAX_CALIBRATION_STEPS))
    fitted = calibrate(job, threads, memory_bandwidth(), profiled)
    return {
        "compute_gflops": fitted.compute_gflops,
        "op_gflops": fitted.op_gflops,
        "memory_gbytes_per_s": fitted.memory_gbytes_per_s,
        "task_overhead_us": fitted.task_overhead_us,
        "compute_factor": fitted.compute_factor,
        "loop_us": fitted.loop_seconds * 1e6,
        "buffer_gbytes_per_s": buffer_pass_rates(),
    }


#: steps of the fresh training whose resident set gives the process baseline
BASELINE_STEPS = 2


def process_baseline_mib(network: str, batch: int) -> float:
    """A rank's resident set beyond its buffers, in MiB: `legion-nn train` of the network for
    `BASELINE_STEPS` steps in a fresh process (no launcher: MPI's libraries add a few MiB under
    `mpiexec`), the most its peak resident set exceeded its buffers' peak at a step's end."""
    from runtime.launch import LAUNCHER_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="legion-nn-baseline-") as tmp:
        log = Path(tmp) / "log.jsonl"
        command = [
            sys.executable, "-m", "cli", "train", network, "--data", "synthetic",
            "--batch", str(batch), "--steps", str(BASELINE_STEPS), "--optimizer", OPTIMIZER,
            "--no-progress", "--no-evaluation", "--log-json", str(log),
        ]  # fmt: skip
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=1800, env=env
        )
        if result.returncode != 0:
            raise LegionNNError(
                f"bench machine: the baseline's training failed: {failure_line(result.stderr)}"
            )
        steps = [json.loads(line) for line in log.read_text().splitlines()]
    excess = [r["rss_peak_bytes"] - r["buffer_peak_bytes"] for r in steps if "step" in r]
    return max(excess) / 2**20


def piece_rows(cache: dict) -> list[dict]:
    """The profile's times as the machine file's `pieces` table."""
    rows = []
    for (threads, key), seconds in sorted(cache.items(), key=lambda item: item[0][1]):
        op, phase, attrs, shape, requirements, *mode = json.loads(key)
        row = {"op": op, "phase": phase, "attrs": attrs, "shape": shape}
        row |= {"requirements": requirements, "threads": threads, "seconds": seconds}
        if mode:  # timed as a step runs it (`runtime.step.piece_modes`)
            row["mode"] = mode[0]
        rows.append(row)
    return rows


def measure_compute(
    network: str,
    batch: int,
    ranks: int,
    strategies: Sequence[str],
    threads: int,
    quick: bool = False,
) -> tuple[list[dict], dict]:
    """The pieces table of the network's plans on 1 and `ranks` ranks and of micro-batches on a
    rank of their own (those only micro-batches run read from traced steps in them), and the
    calibration; `quick`: one pass, fewer micro-batch counts and traced steps (`--quick`).

    Every piece is timed in each of `PROFILE_PASSES` passes over all the plans, and the table
    keeps the median of its passes: the VM this was built on runs minutes-long slow stretches,
    and a piece timed in one of them (each piece's runs are a fraction of a second together)
    read 40% slow. The one-rank plan's pieces, timed one after another, fix the factor
    (`Machine.compute_factor`) that prices every other plan's: one slow stretch over them put
    deep-mlp's model plan 18% short on one cluster variant and 1% on the next.

    The plans are profiled once per optimizer: a job may train with any of them, and only the
    update tasks differ (the other pieces are found in the table), so each optimizer adds its
    updates' pieces and no more. Micro-batches add pieces of their rows alone, the same under
    every optimizer, so they are profiled under one."""
    counts = micro_batch_counts(batch, ranks, quick)
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    schedules = MICRO_SCHEDULES if defers_weight_grads(graph) else MICRO_SCHEDULES[:1]
    runs = [(count, schedule) for count in counts for schedule in schedules]
    passes = [_profile_pass(network, batch, ranks, strategies, threads, runs)
              for _ in range(1 if quick else PROFILE_PASSES)]  # fmt: skip
    cache = {key: statistics.median(times[key] for times, _ in passes) for key in passes[0][0]}
    micro_only = set(cache) - passes[0][1]
    # the one-rank plan's per-task seconds from the table's medians: what the factor is fitted to
    profiled_one = profile_as_run(graph, build_plan(graph, builtin(graph, "data", 1), 1), threads,
                                  sample_step(graph), cache)  # fmt: skip
    fitted = calibrate_in_process(network, batch, threads, profiled_one)
    micro_steps = QUICK_MICRO_STEPS if quick else CALIBRATION_STEPS
    for count, schedule in runs:
        in_step = micro_batch_pieces_in_step(network, batch, count, threads, fitted, micro_steps,
                                             schedule)  # fmt: skip
        cache.update((key, seconds) for key, seconds in in_step.items() if key in micro_only)
    return piece_rows(cache), fitted


def _profile_pass(
    network: str, batch: int, ranks: int, strategies: Sequence[str], threads: int, runs: list
) -> tuple[dict, set]:
    """One pass of `measure_compute`'s profile: every piece of the plans under every optimizer
    and of the micro-batch `runs` (count, schedule) timed once (`task_profile.REPEAT` runs),
    and which of them the whole batch's plans run."""
    cache: dict = {}
    for optimizer in (OPTIMIZER, *(o for o in OPTIMIZERS if o != OPTIMIZER)):
        graph = load_network(network).lower(batch=batch, optimizer=optimizer)
        sample = sample_step(graph)
        profile_as_run(graph, build_plan(graph, builtin(graph, "data", 1), 1), threads, sample,
                       cache)  # fmt: skip
        for count in sorted({ranks} - {1}):
            for strategy in strategies:
                for homes in PARAM_HOMES:  # sharded: each rank's updates of its shards
                    chosen = with_homes(graph, builtin(graph, strategy, count), homes)
                    profile_as_run(graph, build_plan(graph, chosen, count), threads, sample,
                                   cache)  # fmt: skip
        del sample, graph
    whole = set(cache)
    # micro-batches on a rank of their own (a pipeline's stage, or one process) run the pieces
    # of a one-rank step in micro-batches; the optimizers' updates are the whole batch's
    graph = load_network(network).lower(batch=batch, optimizer=OPTIMIZER)
    for count, schedule in runs:
        micro = micro_batched(graph, count, schedule)
        plan = build_plan(micro, builtin(micro, "data", 1), 1)
        profile_plan(micro, plan, threads, sample_step(micro), cache)
    return cache, whole


def _gbytes(seconds_per_byte: float) -> float:
    return 1.0 / seconds_per_byte / 1e9


def measure(
    network: str,
    batch: int,
    strategies: Sequence[str] = STRATEGIES,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict | None:
    """The machine file's object on rank 0 (None on the others); each timed run of a piece,
    the calibration's and the message costs' alike, after the eviction in force
    (`cache_eviction.evicting`), which the file records."""
    from runtime.launch import ranks_on_this_host, share_cores

    say = progress or (lambda line: None)
    threads = share_cores(ranks_on_this_host())
    distributed = world_size_from_env() is not None
    if distributed:
        from runtime import mpi_transport as mpi

        rank, size = mpi.world()
        hosts = mpi.allgather(socket.gethostname())
    else:
        rank, size, hosts = 0, 1, [socket.gethostname()]
    host_count, per_host = _layout(hosts)
    out: dict = {}
    pingpong: list[dict] = []
    sizes = QUICK_LINK_SIZES if quick else LINK_SIZES
    repeat = 5 if quick else 20
    pairs = []
    if host_count > 1:
        pairs.append(("inter_host", 0, per_host))
    if per_host > 1:
        pairs.append(("intra_host", 0, 1))
    links = {}
    for name, a, b in pairs:
        if rank == 0:
            say(f"ping-pong {name}: ranks {a} and {b}")
        times = mpi.link_times(a, b, sizes, repeat)
        large = [size for size in sizes if size >= mpi.SLOPE_FROM_BYTES]
        duplex = mpi.link_times(a, b, large, repeat, duplex=True) if name == "inter_host" else None
        if rank == 0:
            pingpong += [{"pair": name, "bytes": s, "seconds": t} for s, t in zip(sizes, times)]
            links[name] = mpi.fit_link(list(zip(sizes, times)))
            if name == "inter_host":
                burst = mpi.fit_burst(list(zip(sizes, times)), *links[name])
                out["link_burst_bytes"] = burst
            if duplex is not None:  # each way's rate, fitted as the link's is
                pingpong += [
                    {"pair": "duplex", "bytes": s, "seconds": t} for s, t in zip(large, duplex)
                ]
                _, duplex_per_byte = mpi.fit_link(list(zip(large, duplex)))
                out["duplex_gbytes_per_s"] = 1 / duplex_per_byte / 1e9
    if rank == 0:
        say(f"{network} batch {batch}: timing the pieces of its plans on {threads} thread(s)")
        pieces, fitted = measure_compute(network, batch, size, strategies, threads, quick)
        say(f"{network} batch {batch}: a process's baseline memory")
        baseline = process_baseline_mib(network, batch)
    main = links.get("inter_host") or links.get("intra_host")
    latency, per_byte = main if main else (0.0, 0.0)
    per_message = stack = None
    if distributed and size > 1:
        mpi.idle_barrier()
        if rank == 0:
            say(f"the runtime's cost per message: {MESSAGE_JOB[0]} batch {MESSAGE_JOB[1]}, "
                f"{MESSAGE_JOB[2]}, on {size} ranks")  # fmt: skip
            fitted["links"] = {
                "link_gbytes_per_s": _gbytes(per_byte), "latency_us": latency * 1e6,
                "link_burst_bytes": out.get("link_burst_bytes", 0.0), "ranks_per_host": per_host,
                "intra_host": (
                    (links["intra_host"][0] * 1e6, _gbytes(links["intra_host"][1]))
                    if "intra_host" in links and "inter_host" in links else None
                ),
            }  # fmt: skip
        transport = mpi.MPITransport()
        try:
            per_message = message_overhead_us(
                transport, fitted if rank == 0 else {}, threads,
                QUICK_MESSAGE_ROUNDS if quick else MESSAGE_ROUNDS,
            )  # fmt: skip
            if host_count > 1:
                if rank == 0:
                    say("the network stack's CPU: a kernel beside a stream, each way")
                stack = network_stack_costs(transport, per_host, per_byte)
        finally:
            transport.stop_progress()
    if distributed:
        mpi.idle_barrier()
    if rank != 0:
        return None
    rates = fitted["op_gflops"]
    out |= {
        "rank_gflops": fitted["compute_gflops"],
        # one process has no link: a machine file needs one, so it says what the cost model
        # then assumes (the default machine's) and measured_on says there was none
        "link_gbytes_per_s": _gbytes(per_byte) if main else 12.5,
        "latency_us": latency * 1e6 if main else 2.0,
        "rank_memory_gib": _host_memory_gib() / per_host,
        "memory_gbytes_per_s": fitted["memory_gbytes_per_s"],
        "buffer_gbytes_per_s": fitted["buffer_gbytes_per_s"],
        "task_overhead_us": fitted["task_overhead_us"],
        **({"message_overhead_us": per_message["us"]} if per_message is not None else {}),
        **({"network_cpu_ns_per_byte": stack.cpu_ns_per_byte} if stack is not None else {}),
        **{
            key: getattr(stack, key)
            for key in ("computing_gbytes_per_s", "computing_send_gbytes_per_s")
            if stack is not None and getattr(stack, key) is not None
        },
        "process_baseline_mib": baseline,
        "op_gflops": rates,
        "ranks_per_host": per_host,
        "compute_factor": fitted["compute_factor"],
        "loop_us": fitted["loop_us"],
        "pieces": pieces,
        "hosts": host_count,
        "rank_cores": max(1, host_cores() // per_host),
        "host_cores": host_cores(),
        "pingpong": pingpong,
        "measured_on": {
            "network": network,
            "batch": batch,
            "ranks": size,
            "hosts": list(dict.fromkeys(hosts)),
            "threads_per_rank": threads,
            "eviction": cache_eviction.EVICTION,
            "links_measured": [name for name, _, _ in pairs] or "none (one process)",
            **({"message_overhead_rounds_us": per_message["rounds"]} if per_message else {}),
            **({"message_job_steps_s": per_message["steps"]} if per_message else {}),
            **({"network_stack_rounds": stack.rounds} if stack is not None else {}),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "legion_nn": _version(),
        },
    }
    for key in ("task_overhead_us", "loop_us"):  # a cost the fit found none of is left out,
        if not out[key]:  # as `Machine.to_json` leaves it (0 is the default)
            del out[key]
    if "intra_host" in links and "inter_host" in links:
        latency, per_byte = links["intra_host"]
        out["intra_host"] = {"latency_us": latency * 1e6, "gbytes_per_s": _gbytes(per_byte)}
    return out


def _version() -> str:
    try:
        return version("legion-nn")
    except PackageNotFoundError:
        return "unknown"


def _spread(rounds: list[float] | None) -> str:
    """The range of a cost measured in rounds, where there were several."""
    if not rounds or len(rounds) < 2:
        return ""
    return f" (median of {len(rounds)}: {min(rounds):.0f}-{max(rounds):.0f})"


def format_summary(machine: dict) -> str:
    intra = machine.get("intra_host")
    lines = [
        (
            f"hosts {machine['hosts']}, {machine['ranks_per_host']} rank(s) per host, "
            f"{machine['rank_cores']} core(s) and {machine['rank_memory_gib']:.1f} GiB per rank"
        ),
        f"link: {machine['latency_us']:.1f} us, {machine['link_gbytes_per_s']:.3f} GB/s"
        + (
            f" (both ways at once: {machine['duplex_gbytes_per_s']:.3f} GB/s)"
            if "duplex_gbytes_per_s" in machine
            else ""
        )
        + (
            f", {machine['link_burst_bytes'] / 1024:.0f} KiB at once when idle"
            if machine.get("link_burst_bytes")
            else ""
        )
        + (
            f", {machine['network_cpu_ns_per_byte']:.2f} ns of CPU a byte"
            if "network_cpu_ns_per_byte" in machine
            else ""
        )
        + (
            f", {machine['computing_gbytes_per_s']:.3f} GB/s into a kernel's rank"
            if "computing_gbytes_per_s" in machine
            else ""
        )
        + (
            f", {machine['computing_send_gbytes_per_s']:.3f} GB/s out of it"
            if "computing_send_gbytes_per_s" in machine
            else ""
        ),
    ]
    if intra:
        lines.append(
            f"within a host: {intra['latency_us']:.1f} us, {intra['gbytes_per_s']:.2f} GB/s"
        )
    by_op: dict[str, float] = defaultdict(float)
    for row in machine["pieces"]:
        by_op[f"{row['op']}.{row['phase']}"] += row["seconds"]
    lines.append(
        f"{len(machine['pieces'])} pieces timed; per-task overhead "
        f"{machine.get('task_overhead_us', 0.0):.1f} us, kernels in a step x{machine['compute_factor']:.2f}, "
        f"{machine.get('loop_us', 0.0):.0f} us a step outside tasks, memory "
        f"{machine['memory_gbytes_per_s']:.1f} GB/s"
        + (
            ", the runtime's "
            + ", ".join(f"{k} {v:.1f}" for k, v in machine["buffer_gbytes_per_s"].items())
            + " GB/s"
            if "buffer_gbytes_per_s" in machine
            else ""
        )
        + (
            f", {machine['message_overhead_us']:.0f} us a message"
            if "message_overhead_us" in machine
            else ""
        )
        + _spread(machine.get("measured_on", {}).get("message_overhead_rounds_us"))
    )
    if "process_baseline_mib" in machine:
        lines.append(
            f"a rank's process holds {machine['process_baseline_mib']:.0f} MiB besides its buffers"
        )
    return "\n".join(lines) + "\n"
