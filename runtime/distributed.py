"""Distributed training: one rank's run of the training loop over a transport.

`legion-nn train` under `mpiexec -n R` runs `train_rank` on every rank with the MPI transport
(in the child of a watcher, see `runtime.supervisor`), and one process runs it as rank 0 of
1 over `ThreadTransport`. The loop is `runtime.training.Trainer` over a `RankExecutor`: the same
batches, the same seeds, and so the same losses and parameters up to the order of sums.

Rank 0 owns the outputs. It writes the `--log-json` records of every rank (each rank's
`bytes_sent`, counted from its own MPI calls, beside its `bytes_planned`), the checkpoints, the
progress bar and the `--trace` file, collecting the other ranks' trace events after each step.

How a job is launched is read from the environment (`runtime.launch`), without importing mpi4py,
so that a plain `legion-nn train` never initialises MPI.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.resolve import resolve_stages, strategy_chooser
from partitioner.search.stages import AUTO_STAGES, pipeline_label
from partitioner.strategy import Strategy
from runtime.rank_executor import RankExecutor
from runtime.step.model import StepModel
from runtime.supervisor import Status
from runtime.tracing import Recorder, TraceFile
from runtime.training import TrainConfig, Trainer, TrainResult
from runtime.transport import Transport, wait, wait_object

TAG_CLOCK, TAG_TRACE = 10, 11


@dataclass
class RunOptions:
    strategy: str = "data"
    #: `--param-homes` (None: replicated, or auto's choice)
    param_homes: str | None = None
    machine: Machine | None = None
    stall_timeout: float = 60.0
    trace: str | None = None
    search_seconds: float = 30.0
    #: check every plan with `verify_plan` before it runs
    verify: bool = False

    @property
    def label(self) -> str:
        """The strategy as the console names it: `data, sharded homes`."""
        homes = f", {self.param_homes} homes" if self.param_homes else ""
        return f"{self.strategy}{homes}"


def strategy_spec(options: RunOptions) -> str | Callable[[TaskGraph, int], Strategy]:
    """A built-in name, or how rank 0 chooses (`auto`, a grids file) for the first graph
    (`partitioner.resolve.strategy_chooser`); a bad one fails on every rank alike, before MPI."""
    machine = options.machine or Machine()
    model = StepModel(machine)
    return strategy_chooser(
        options.strategy,
        machine,
        options.search_seconds,
        options.param_homes,
        model.peak,
        model.step,
    )


def _choose_stages(config: TrainConfig, executor: RankExecutor, options: RunOptions) -> TrainConfig:
    """`config` in the stages, micro-batches, cuts and schedule of least predicted step, and the executor
    set to the strategy planned with them: rank 0 chooses (`partitioner.resolve.resolve_stages`)
    and tells every rank."""

    def choose() -> tuple[int, int, tuple[str, ...], str, Strategy]:
        machine = options.machine or Machine()
        model = StepModel(machine)
        graph = config.network.lower(
            batch=config.batch,
            dtype=config.dtype,
            optimizer=config.optimizer,
            hyperparameters=config.hyperparameters,
        )
        _, strategy, _, search = resolve_stages(
            graph,
            options.strategy,
            executor.nranks,
            machine,
            options.search_seconds,
            config.schedule,
            config.micro_batches,
            None,
            options.param_homes,
            model.peak,
            model.step,
            model.step_lower_bound,
            model.step_is_sum,
            compared=model.compared_steps,
        )
        chosen = search.chosen
        return chosen.stages, chosen.micro_batches, chosen.cuts, chosen.schedule, strategy

    stages, count, cuts, schedule, strategy = executor.broadcast(choose, "the pipeline")
    executor.settle(strategy)
    return replace(config, stages=stages, micro_batches=count, cuts=cuts, schedule=schedule)


def _pipeline_line(config: TrainConfig) -> str:
    chosen = pipeline_label(config.stages, config.micro_batches, config.cuts or (), config.schedule)
    return f"--stages auto: {chosen} (least predicted)"


class Timeline:
    """Aligned clocks and the trace file: events flow to rank 0 after every step."""

    def __init__(self, transport: Transport, path: str | None, info: dict, timeout: float):
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.timeout = timeout
        self.recorder = Recorder(self.rank) if path else None
        self.file = TraceFile(path, self.size, info) if path and self.rank == 0 else None
        if self.recorder is not None:
            self._align()

    def _align(self) -> None:
        """Rank 0 says go once every rank is ready; all take that moment as time zero."""
        t = self.transport
        if self.rank == 0:
            for src in range(1, self.size):
                wait_object(t.recv_object(src, TAG_CLOCK), src, "aligning clocks", 0, self.timeout)
            for dst in range(1, self.size):
                t.send_object("go", dst, TAG_CLOCK)
        else:
            t.send_object("ready", 0, TAG_CLOCK)
            wait_object(t.recv_object(0, TAG_CLOCK), 0, "aligning clocks", self.rank, self.timeout)
        self.recorder.align(self.recorder.now())

    def collect(self, final: bool = False) -> None:
        if self.recorder is None:
            return
        events = self.recorder.take()
        if self.rank != 0:
            self.transport.send_object(events, 0, TAG_TRACE)
            return
        self.file.extend(events)
        pending = [(self.transport.recv_object(src, TAG_TRACE), src) for src in range(1, self.size)]
        wait(pending, "collecting trace events", 0, self.timeout)
        for request, _ in pending:
            self.file.extend(request.value)
        self.file.write(force=final)


def train_rank(
    config: TrainConfig,
    transport: Transport,
    options: RunOptions,
    status: Status | None = None,
    log: IO[str] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_epoch: Callable[[str], None] | None = None,
    before_first_step: Callable[[TaskGraph, object], None] | None = None,
) -> TrainResult:
    """This rank's part of training `config`; rank 0's result carries the accuracies."""
    info: dict[str, Any] = {"network": config.network.name, "strategy": options.strategy}
    timeline = Timeline(transport, options.trace, info, options.stall_timeout)
    executor = RankExecutor(
        transport,
        strategy_spec(options),
        options.machine,
        seed=config.seed,
        stall_timeout=options.stall_timeout,
        recorder=timeline.recorder,
        on_task=status.set if status is not None else None,
        verify_plans=options.verify,
        clip_grad_norm=config.clip_grad_norm,
    )
    root = transport.rank == 0
    if config.stages == AUTO_STAGES:
        config = _choose_stages(config, executor, options)
        if root and on_epoch is not None:
            on_epoch(_pipeline_line(config))
    where = executor.gather({"pid": os.getpid(), "host": socket.gethostname()})
    if root and log is not None:
        for rank, record in enumerate(where):
            log.write(json.dumps({"event": "start", "rank": rank, **record}) + "\n")
        pipeline = {
            "stages": config.stages,
            "micro_batches": config.micro_batches,
            "schedule": config.schedule,
        }
        log.write(json.dumps({"event": "pipeline", **pipeline, "cuts": config.cuts}) + "\n")
        log.flush()
    trainer = Trainer(
        config,
        log=log if root else None,
        on_step=on_step if root else None,
        on_epoch=on_epoch if root else None,
        executor=executor,
        after_step=lambda step: timeline.collect(),
        before_first_step=before_first_step,
    )
    try:
        result = trainer.run()
    finally:
        if timeline.file is not None:
            timeline.file.write(force=True)  # what has arrived so far, even on the way out
    timeline.collect(final=True)
    return result
