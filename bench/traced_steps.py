"""Traced one-rank trainings in this process, and what `bench machine` reads from them: the
pieces only micro-batches run, timed as a running step runs them.

`traced_training` runs `legion-nn train` of a network on one rank in this process with a trace,
in micro-batches where asked. `bench machine` fits the runtime's own costs to it
(`bench.machine.calibrate_in_process`) and reads from traced steps in micro-batches the pieces
only micro-batches run (`micro_batch_pieces_in_step`), at the counts a job may stream
(`micro_batch_counts`) and under both `MICRO_SCHEDULES`.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.calibration import task_medians
from bench.jobs import OPTIMIZER, Job, log_records, median_step
from legion_nn.micro_batches import micro_batched
from legion_nn.network import Network
from legion_nn.networks import load_network
from partitioner.piece_times import piece_key
from partitioner.plan import build_plan
from partitioner.search.stages import micro_batch_counts as pipeline_micro_batch_counts
from partitioner.strategy import builtin
from runtime import data
from runtime.dataset import Dataset, Split
from runtime.distributed import RunOptions, train_rank
from runtime.training import TrainConfig
from runtime.transport import ThreadTransport

#: steps of the traced one-rank training that calibrates the runtime's own costs
CALIBRATION_STEPS = 12
#: the traced steps of each micro-batch count with `--quick` (two after the warm-up)
QUICK_MICRO_STEPS = 4


def traced_training(
    network: str,
    batch: int,
    micro_batches: int = 1,
    steps: int = CALIBRATION_STEPS,
    schedule: str = "1f1b",
) -> Job:
    """A traced one-rank training of `network` in this process for `steps` steps, its batch as
    `micro_batches` micro-batches in `schedule`'s order."""
    graph_network = load_network(network)
    dataset = samples_read(graph_network, batch, steps)
    config = TrainConfig(
        network=graph_network,
        dataset=dataset,
        batch=batch,
        steps=steps,
        optimizer=OPTIMIZER,
        micro_batches=micro_batches,
        schedule=schedule,
    )
    with tempfile.TemporaryDirectory(prefix="legion-nn-machine-") as tmp:
        trace_path = Path(tmp) / "trace.json"
        log = io.StringIO()
        (transport,) = ThreadTransport.group(1)
        train_rank(config, transport, RunOptions(strategy="data", trace=str(trace_path)), log=log)
        trace = json.loads(trace_path.read_text())
    return Job(network, batch, 1, "data", median_step(log_records(log)), 0, trace)


def samples_read(network: Network, batch: int, steps: int) -> Dataset:
    """Synthetic data for a timed training of `network`, cut to what it reads: its steps'
    samples, and a batch of each split for the evaluations at its end (which read every sample
    of the three splits, and took longer than the steps timed)."""
    dataset = data.load("synthetic", network.input, network.classes, 0, np.float32)

    def first(split: Split, count: int) -> Split:
        return Split(split.x[:count], split.y[:count])

    return replace(
        dataset,
        train=first(dataset.train, batch * steps),
        val=first(dataset.val, batch),
        test=first(dataset.test, batch),
    )


def micro_batch_counts(batch: int, ranks: int, quick: bool = False) -> list[int]:
    """The micro-batch counts whose pieces are timed: 2, 4 and 8 in one process, and those
    `--stages auto` tries in a pipeline of S = R stages, a rank each
    (`partitioner.search.stages.micro_batch_counts`); at most the batch. `quick`: 2·R alone."""
    if quick:  # `--quick`: the default pipeline's alone
        counts = {2 * ranks}
    else:
        counts = {2, 4, 8} | set(
            pipeline_micro_batch_counts(batch, ranks, None) if ranks > 1 else ()
        )
    return sorted(m for m in counts if m <= batch)


#: the schedules whose micro-batches' pieces are timed: each micro-batch adding into the
#: weights' gradients, and the gradients deferred to one task over them all (the pieces differ)
MICRO_SCHEDULES = ("1f1b", "1f1b-deferred")


def micro_batch_pieces_in_step(
    network: str,
    batch: int,
    count: int,
    threads: int,
    fitted: dict,
    steps: int = CALIBRATION_STEPS,
    schedule: str = "1f1b",
) -> dict[tuple[int, str], float]:
    """The pieces of a one-rank step in `count` micro-batches, as a traced training of it runs
    them (the median over its steps and over the micro-batches' copies of a task, less the
    per-task overhead), over `fitted`'s compute factor: what the table holds, so that the
    factor gives them back. Timed alone, a micro-batch's backward misses what the step costs
    it: each adds into a weight-sized gradient that the micro-batch's other tasks have pushed
    out of the caches (a 32-row backward through a 2048-wide layer, 6.5 ms alone and 8.4 ms in
    a step, one core). The whole batch's pieces are left as timed: their gradients are
    written once a step, and `compute_factor` is fitted to them."""
    job = traced_training(network, batch, count, steps, schedule)
    graph = micro_batched(
        load_network(network).lower(batch=batch, optimizer=OPTIMIZER), count, schedule
    )
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    spent = task_medians(job.trace)
    by_key: dict[tuple[int, str], list[float]] = defaultdict(list)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task.name not in spent or len(task_plan.pieces) != 1:
            continue
        piece = task_plan.pieces[0]
        by_key[(threads, piece_key(task, piece.rect.shape, piece.requirements))].append(
            spent[task.name]
        )
    overhead = fitted["task_overhead_us"] * 1e-6
    factor = fitted["compute_factor"]
    return {
        key: max(statistics.median(times) - overhead, 1e-9) / factor
        for key, times in by_key.items()
    }
