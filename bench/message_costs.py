"""What a message costs a rank beyond its link, measured on every rank of a running job (`bench
machine`'s last two measurements; `partitioner.machine_file` names the keys):

- `message_overhead_us`: the runtime's bookkeeping and MPI calls per message endpoint, fitted so
  that the simulated step of a job made mostly of messages (`MESSAGE_JOB`) equals its measured
  one, the median of `MESSAGE_ROUNDS` runs;
- `network_cpu_ns_per_byte` and `computing_gbytes_per_s`: what the network stack costs a rank's
  kernels per byte it sends or receives between hosts, and how fast those bytes cross while the
  kernel runs, from a kernel timed alone and with a stream each way beside it.
"""

from __future__ import annotations

import io
import math
import statistics
import time
from dataclasses import dataclass, field, replace

import numpy as np
from numba import njit

from bench.jobs import OPTIMIZER, log_records, median_step
from bench.task_profile import profile_as_run, sample_step
from bench.traced_steps import samples_read
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.distributed import RunOptions, train_rank
from runtime.launch import host_cores
from runtime.training import TrainConfig
from runtime.transport import ThreadTransport

#: the job that prices a message: (network, batch, strategy). Small pieces and many messages,
#: so that its step is mostly the runtime's costs per task and per message
MESSAGE_JOB = ("seed-lcn-small", 4, "model")
MESSAGE_STEPS = 40
#: the message job's measurements, each fitted on its own: the cost is their median. One job's
#: fit moved from 57 to 91 us in five runs on a quiet emulated cluster (and to over 300 us with
#: other work beside it), since it is the difference of two measured steps over their messages.
#: Its step moves between two speeds from run to run (on nic-egress, 3.4-4.7 ms, or 5.0-6.3 ms
#: where a rank's kernels took 3.4-3.6 ms a step where they take 2.0-2.3: ten runs of 40 steps,
#: the job alone beside each at 2.1-2.3 ms), so three runs fitted 208, 20 and 30 us in one file
#: and 212, 209 and 120 in another made minutes before; seed-lcn-small's model plan at batch 64
#: was then predicted 26% short on the first. Nine runs, as two files of eight: 117 and 154 us.
MESSAGE_ROUNDS = 9
#: and `bench machine --quick`'s (the tests')
QUICK_MESSAGE_ROUNDS = 3


def message_overhead_us(
    transport, fitted: dict, threads: int, rounds: int = MESSAGE_ROUNDS
) -> dict | None:
    """Run `MESSAGE_JOB` on every rank of `transport`, `rounds` times, and on rank 0
    fit the runtime's cost per message endpoint to each, in us: the cost at which the simulated
    step of the job's plan falls short of its measured step (the median over its steps of the
    slowest rank's) by as much as the job's simulated step on one rank falls short of its own,
    measured just after (no messages there: the loop and the per-task terms, which are the
    calibration's, `fitted`), found by bisection (the simulated step grows with it). The job's
    pieces are timed on rank 0, so that its compute is measured, not modelled, and the
    simulation shares the cores as the job's ranks did (`host_cores`). Rank 0 returns
    `{"us": the median, "rounds": each round's, "steps": each round's measured step, one-rank
    step and one-rank simulated step}`; the others None."""
    from partitioner.machine import Machine
    from runtime import mpi_transport as mpi
    from runtime.step.prediction import predict_step
    from runtime.step.programs import build_programs

    name, batch, strategy = MESSAGE_JOB
    network = load_network(name)
    dataset = samples_read(network, batch, MESSAGE_STEPS)
    config = TrainConfig(network=network, dataset=dataset, batch=batch, steps=MESSAGE_STEPS,
                         optimizer=OPTIMIZER)  # fmt: skip
    graph = network.lower(batch=batch, optimizer=OPTIMIZER)
    plan = build_plan(graph, builtin(graph, strategy, transport.size), transport.size)
    one = build_plan(graph, builtin(graph, "data", 1), 1)
    base = programs = alone_simulated = None
    if transport.rank == 0:
        cache: dict = {}
        sample = sample_step(graph)
        profile_as_run(graph, plan, threads, sample, cache)
        profile_as_run(graph, one, threads, sample, cache)
        base = Machine(
            task_overhead_us=fitted["task_overhead_us"], compute_factor=fitted["compute_factor"],
            memory_gbytes_per_s=fitted["memory_gbytes_per_s"], host_cores=host_cores(),
            pieces={key: seconds for (_, key), seconds in cache.items()},
            **fitted["links"],
        )  # fmt: skip
        # a plan's programs follow its links, not the cost per message: built once for the fit
        programs = build_programs(graph, plan, base, range(plan.nranks))
        alone_simulated = predict_step(graph, one, base).seconds
    fits, steps = [], []
    for _ in range(rounds):
        mpi.idle_barrier()
        log = io.StringIO()
        train_rank(config, transport, RunOptions(strategy=strategy), log=log)
        mpi.idle_barrier()
        if transport.rank != 0:
            continue
        measured = median_step(log_records(log))
        # the same job on one rank of this process: it has no messages, so what its simulation
        # misses is the runtime's cost per task at these sizes, which the fit must not take for
        # a cost per message (the other ranks sleep meanwhile, in the barrier above)
        alone_log = io.StringIO()
        (alone,) = ThreadTransport.group(1)
        train_rank(config, alone, RunOptions(strategy="data"), log=alone_log)
        measured_alone = median_step(log_records(alone_log))
        # what the one-rank step takes beyond its simulated tasks (the loop, the job's own
        # per-task costs at these sizes) the R-rank step takes too, as it runs the same tasks
        target = measured - (measured_alone - alone_simulated)
        fits.append(_fitted_overhead_us(graph, plan, programs, base, target))
        steps.append([measured, measured_alone, alone_simulated])
    if transport.rank != 0:
        return None
    return {"us": statistics.median(fits), "rounds": fits, "steps": steps}


def _fitted_overhead_us(graph, plan, programs, base, target: float) -> float:
    """The cost per message endpoint (us) at which `plan`'s simulated step (of its `programs`)
    on `base` is `target` seconds, by bisection; 0 where the step is longer without any."""
    from runtime.step.prediction import predict_step

    def simulated(overhead_us: float) -> float:
        machine = replace(base, message_overhead_us=overhead_us)
        return predict_step(graph, plan, machine, programs=programs).seconds

    low, high = 0.0, 1000.0
    if simulated(low) >= target:
        return 0.0
    while simulated(high) < target and high < 1e6:
        high *= 4
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < target else (low, middle)
    return (low + high) / 2


#: the kernel whose slowdown prices the network stack: about this long alone
STACK_PROBE_S = 0.25
#: the stream beside it lasts this many times the kernel at the link's rate, so that it is still
#: crossing when the kernel ends
STACK_STREAM_SPAN = 1.5
STACK_MAX_BYTES = 512 << 20
#: the stream's messages: this many, each of at least `STACK_MIN_CHUNK` bytes (large enough to
#: go by MPI's rendezvous, so that a send is done when its bytes have left)
STACK_CHUNKS = 64
STACK_MIN_CHUNK = 1 << 20
#: streams each way, the median kept: of three, one file of two measured 3 minutes apart on the
#: same unshaped veth read the stack's CPU at 1.31 ns a byte against 0.82 (deep-mlp's data plan
#: there then predicted 0.57 s against 0.49 from the other's 0.86, measured 0.57)
STACK_ROUNDS = 5
#: a rate while the kernel runs within this share of the link's own is the link's: nothing holds
#: the stream back (the count of messages done is good to a message, and the stream's first
#: message waits for MPI's handshake; a link the progress thread keeps up with, 400 Mbit/s tbf,
#: read 0.9 of its rate)
HELD_BELOW = 0.25


@dataclass(frozen=True)
class StackCosts:
    """What the bytes crossing between hosts do to a rank that computes meanwhile."""

    #: CPU taken from the kernel per byte that crossed while it ran (`network_cpu_ns_per_byte`)
    cpu_ns_per_byte: float
    #: how fast those it received crossed meanwhile (`computing_gbytes_per_s`), None where at
    #: the link's rate
    computing_gbytes_per_s: float | None
    #: and those it sent (`computing_send_gbytes_per_s`)
    computing_send_gbytes_per_s: float | None
    #: each stream's figures, for the record (`measured_on`): the CPU a byte in ns, and the
    #: GB/s it crossed at while the kernel ran (None: done within it), into and out of rank 0
    rounds: dict[str, list] = field(default_factory=dict)


@njit(nogil=True)
def _busy(rounds: int, values: np.ndarray) -> float:
    """Arithmetic on a few cache lines: a kernel that needs the core and not the memory."""
    total = 0.0
    for _ in range(rounds):
        for i in range(values.shape[0]):
            total = total * 0.999999 + values[i]
    return total


def _timed_busy(rounds: int, values: np.ndarray) -> float:
    start = time.perf_counter()
    _busy(rounds, values)
    return time.perf_counter() - start


def stream_crossed(done: int, chunks: int, chunk: int) -> float:
    """Bytes of a stream of `chunks` messages of `chunk` bytes that have crossed when its first
    `done` are done: those, and, where the stream goes on, half the one in flight (its bytes
    are not counted by a request; it is half through on average). A stream held back below a
    message in the kernel's time is not taken to have stood still: on nic-egress, a rank
    sending from a kernel finished no 8 MiB message of it in three of five streams, and the
    rate read as 0 (which a machine file cannot hold: it would be no limit at all)."""
    return float(done * chunk) if done >= chunks else (done + 0.5) * chunk


def network_stack_costs(transport, peer: int, seconds_per_byte: float) -> StackCosts | None:
    """What moving bytes between hosts costs a rank that computes meanwhile (on rank 0; None
    elsewhere): rank 0 runs a kernel alone, then while `peer` (on another host) streams to it,
    then while it streams to `peer`. The stream is posted before the kernel starts, moved
    meanwhile by the transport's progress thread as in a training step, and sized to outlast
    the kernel at the link's rate. When the kernel ends, rank 0 counts the stream's messages
    done: the bytes that crossed while it ran. Their rate over the kernel's time is how fast a
    message moves while the rank it goes to computes (rank 0 receives), and while the rank it
    leaves does (rank 0 sends; unbounded where the stream was done first); the kernel's time
    beyond the kernel alone timed just before, over those bytes, what each cost its core, both
    ways. The median of `STACK_ROUNDS` streams each way, the CPU the mean of both directions.

    Those are what the simulators charge (`runtime.step.simulator`): the transfers a kernel's
    rank receives and sends between hosts move at most those rates while it runs, and it takes
    its seconds plus that CPU for each byte on the wire meanwhile, so by construction they give
    this experiment's kernel. MPI takes a message in over TCP only when its rank calls into MPI,
    and a rank in a kernel leaves that to the progress thread's calls, each reading what the
    socket's buffer holds. Measured on 2 emulated hosts of one core each (an AMD EPYC VM): an
    unshaped veth with offloads took in 0.27-0.37 GB/s while the kernel ran, and sent about as
    slowly, against 1.4-1.6 GB/s each way while the ranks waited; without offloads it took in
    0.18-0.23 GB/s, while a stream it sent crossed at the link's rate and stretched the kernel
    from 0.25 to 0.55 s (the host's core moves both ends' bytes). Timed until both kernel and
    stream were done instead, the stack's CPU read 0.5-1.2 ns a byte, and the simulators had
    the kernel wait for the stream at the link's rate: seed-lcn's data-parallel step with
    offloads was predicted 10% short, its all-reduce running beside the backward pass in the
    prediction and mostly after it in the run."""
    from runtime import mpi_transport as mpi

    rank = transport.rank
    values = np.random.default_rng(0).standard_normal(512)
    rounds = 1000
    if rank == 0:
        _timed_busy(1, values)  # compiled
        while _timed_busy(rounds, values) < STACK_PROBE_S / 8:
            rounds *= 2
        rounds = int(rounds * STACK_PROBE_S / _timed_busy(rounds, values))
        span = _timed_busy(rounds, values) * STACK_STREAM_SPAN
        nbytes = min(int(span / seconds_per_byte), STACK_MAX_BYTES)
    else:
        nbytes = 0
    nbytes = mpi.broadcast(nbytes)
    chunk = max(nbytes // STACK_CHUNKS, STACK_MIN_CHUNK)
    chunks = max(nbytes // chunk, 1)
    costs: dict[tuple[int, int], list[float]] = {}
    rates: dict[int, list[float]] = {}
    for sender, receiver in ((peer, 0), (0, peer)) * STACK_ROUNDS:
        # timed while the peer waits in the barrier, so that nothing moves beside it
        alone = _timed_busy(rounds, values) if rank == 0 else 0.0
        mpi.idle_barrier()
        requests = []
        if rank in (sender, receiver):
            buffers = [np.ones(chunk, np.uint8) for _ in range(chunks)]
            for index, buffer in enumerate(buffers):
                if rank == sender:
                    requests.append(transport.isend(buffer, receiver, transport.data_tag(index)))
                else:
                    requests.append(transport.irecv(buffer, sender, transport.data_tag(index)))
        if rank == 0:
            start = time.perf_counter()
            with transport.computing():
                _busy(rounds, values)
            took = time.perf_counter() - start
            # a pair's messages cross in order: those done lead the list
            done = next((i for i, r in enumerate(requests) if not r.test()), chunks)
            crossed = stream_crossed(done, chunks, chunk)
            costs.setdefault((sender, receiver), []).append(
                max(took - alone, 0.0) / max(crossed, chunk)
            )
            # a stream done within the kernel was not held back
            rates.setdefault(sender, []).append(crossed / took if done < chunks else math.inf)
        while not all(r.test() for r in requests):
            time.sleep(1e-4)
    mpi.idle_barrier()
    if rank != 0:
        return None
    cpu = statistics.mean(statistics.median(each) for each in costs.values())

    def held(rate: float) -> float | None:
        return rate / 1e9 if rate < (1.0 - HELD_BELOW) / seconds_per_byte else None

    def gbytes(rate: float) -> float | None:
        return rate / 1e9 if math.isfinite(rate) else None

    return StackCosts(
        cpu * 1e9,
        held(statistics.median(rates[peer])),
        held(statistics.median(rates[0])),
        {
            "cpu_ns_per_byte_in": [c * 1e9 for c in costs[peer, 0]],
            "cpu_ns_per_byte_out": [c * 1e9 for c in costs[0, peer]],
            "gbytes_per_s_in": [gbytes(r) for r in rates[peer]],
            "gbytes_per_s_out": [gbytes(r) for r in rates[0]],
        },
    )
