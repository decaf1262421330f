"""The training loop: batches in, task graphs executed, losses logged, checkpoints kept.

Each step runs the whole lowered graph (forward, zeroing, backward, updates) on one batch; the
loss and the evaluate statistics are read from their tensors afterwards. Which samples make a step
is a pure function of (seed, epoch, step in epoch), and dropout masks of (seed, step), so a run
resumed from a checkpoint continues with exactly the losses an uninterrupted run would produce.

A graph is lowered for each batch size met (the last batch of an epoch is usually smaller);
lowering takes a millisecond, and the executor shares parameters between them by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import numpy as np

from legion_nn.cycles import collecting_past_setup
from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.lowering import OPTIMIZERS
from legion_nn.network import Network
from legion_nn.verify import verify
from partitioner.pipeline import step_graph
from runtime import checkpoint
from runtime.adapters import StepContext
from runtime.data_dir import Batch, NpyFile, Prefetcher
from runtime.dataset import Dataset, Split
from runtime.lr_schedule import LRSchedule
from runtime.rank_executor import NotOfThisNetwork, one_process


class Executor(Protocol):
    """What `runtime.training.Trainer` needs of an executor: run steps of the graphs it lowers,
    read small results, and take part in gathering log records and checkpoints.

    Collective calls (`run`, `run_inference`, `gather`, `resident`) are made by every rank in the
    same order; values that live on one rank come back on rank 0 (`is_root`) and None elsewhere.
    """

    @property
    def is_root(self) -> bool: ...

    def prepare(self, graph: TaskGraph, initial: dict[str, np.ndarray] | None = None) -> object:
        """Plan `graph` and allocate what it needs (resident tensors once, for the whole run),
        parameters and state from `initial` (whole logical arrays) where given."""

    def run(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        """One training step of `graph`: forward, zeroing, backward and updates."""

    def run_inference(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        """The forward pass of `graph` alone (`legion_nn.graph.inference_tasks`)."""

    def value(self, name: str) -> np.ndarray | None:
        """A whole small tensor (the loss, evaluate's sums) where it is held, else None."""

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value`, in rank order, on rank 0."""

    def step_extras(self) -> dict[str, Any]:
        """What the last step's log record adds: bytes sent and planned, the runtime's buffer
        peak (`buffer_peak_bytes`) and the process's peak resident set (`rss_peak_bytes`)."""

    def resident(self) -> dict[str, np.ndarray] | None:
        """Parameters and state, whole and logical, on rank 0: what a checkpoint holds."""


@dataclass
class TrainConfig:
    network: Network
    dataset: Dataset
    batch: int = 32
    epochs: int = 10
    steps: int | None = None
    dtype: str = "float32"
    seed: int = 0
    optimizer: str = "adam"
    #: the optimizer's (`legion_nn.lowering.OPTIMIZERS`): lr, weight_decay, momentum, betas, eps
    hyperparameters: dict[str, float] = field(default_factory=dict)
    #: the factor on the learning rate at each step
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    #: scale the step's gradients to this norm over every parameter at most (None: never)
    clip_grad_norm: float | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    #: also checkpoint every this many steps (None: at the end of each epoch and of the run only)
    checkpoint_every: int | None = None
    #: checkpoints kept: the newest, and the oldest of them removed as each is written
    keep: int = checkpoint.KEEP
    #: False: step s takes rows [s·B, (s+1)·B) of the epoch's training set, in order
    shuffle: bool = True
    #: where to write the trained ONNX model (the network must have been read from one)
    save_onnx: str | None = None
    #: each step's batch runs as this many micro-batches, in `schedule`'s order
    #: (`legion_nn.micro_batches`; None under `--stages auto` until the search chooses it); a
    #: batch of fewer samples runs one per sample
    micro_batches: int | None = 1
    schedule: str | None = "1f1b"
    #: pipeline stages the layers are cut into (`partitioner.pipeline`), each on its share of
    #: the ranks, the micro-batches streamed through them; `search.stages.AUTO_STAGES`: chosen
    #: with the micro-batches (where None) and the cuts by prediction, before the first step
    #: (`runtime.distributed.train_rank`)
    stages: int | str = 1
    #: the first layer of each stage after the first (`partitioner.pipeline.stages_at`); None:
    #: the stages balance the layers' FLOPs
    cuts: tuple[str, ...] | None = None
    #: False: the run makes no evaluation (no validation at the epochs' ends, no final test and
    #: training accuracy), for runs that time their steps: those fields of the log are null
    evaluation: bool = True

    def __post_init__(self) -> None:
        """Refuse checkpointing that cannot work before anything runs or is written (the
        command line makes its config before it opens its log)."""
        if self.checkpoint_every is not None and not self.checkpoint_dir:
            raise LegionNNError("--checkpoint-every needs --checkpoint DIR")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise LegionNNError(
                f"--checkpoint-every must be at least 1, got {self.checkpoint_every}"
            )
        if self.keep < 1:
            raise LegionNNError(f"--keep must be at least 1, got {self.keep}")
        if self.checkpoint_dir:
            checkpoint.check_directory(self.checkpoint_dir, self.resume)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.dataset.train) / self.batch)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch

    @property
    def evaluation_batches(self) -> int:
        """The forward passes the run's evaluations make (`Trainer`): the validation split at
        the end of every epoch the steps reach and of the last step, then the validation, test
        and training splits once more, each in batches of `batch` (none without `evaluation`)."""
        if not self.evaluation:
            return 0

        def batches(split: Split) -> int:
            return math.ceil(len(split) / self.batch)

        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        data = self.dataset
        return (epochs + 1) * batches(data.val) + batches(data.test) + batches(data.train)


@dataclass
class TrainResult:
    losses: list[float]
    val_accuracy: float
    test_accuracy: float
    train_accuracy: float
    steps: int
    seconds: float


def fingerprint(network: Network) -> str:
    return hashlib.sha256(json.dumps(network.to_spec(), sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        log: IO[str] | None = None,
        on_step: Callable[[int, float], None] | None = None,
        on_epoch: Callable[[str], None] | None = None,
        executor: Executor | None = None,
        after_step: Callable[[int], None] | None = None,
        before_first_step: Callable[[TaskGraph, object], None] | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self.on_step = on_step
        self.on_epoch = on_epoch
        #: called on every rank after every step (the trace collection of distributed runs)
        self.after_step = after_step
        #: called on every rank with the step's graph and what the executor's `prepare` gave
        #: for it, once it is prepared (the compiling of the kernels ahead, see
        #: `runtime.compile_ahead`)
        self.before_first_step = before_first_step
        #: a rank's executor; a one-process run's unless given one
        self.executor: Executor = (
            executor
            if executor is not None
            else one_process(config.seed, clip_grad_norm=config.clip_grad_norm)
        )
        if getattr(self.executor, "clip_grad_norm", None) != config.clip_grad_norm:
            raise ValueError("the executor clips gradients otherwise than the configuration")
        self._graphs: dict[int, TaskGraph] = {}
        train = config.dataset.train
        if len(train) == 0:
            raise LegionNNError("the training split is empty")
        self.steps_per_epoch = config.steps_per_epoch
        self.total_steps = config.total_steps
        #: the steps done at the last checkpoint written or resumed from
        self._saved: int | None = None
        #: (epoch, the order of its samples), made once an epoch
        self._order: tuple[int, np.ndarray] | None = None
        #: a training set read in place: its reader, and the last step's batch (whose rects it reads
        #: ahead for the next)
        self._prefetcher: Prefetcher | None = None
        self._last_batch: np.ndarray | Batch | None = None

    def graph(self, batch: int) -> TaskGraph:
        if batch not in self._graphs:
            c = self.config
            graph = c.network.lower(
                batch=batch, dtype=c.dtype, optimizer=c.optimizer, hyperparameters=c.hyperparameters
            )
            graph = step_graph(graph, c.stages, min(c.micro_batches, batch), c.schedule, c.cuts)
            verify(graph)  # the invariants every executor relies on (milliseconds)
            self._graphs[batch] = graph
        return self._graphs[batch]

    def identity(self) -> dict[str, Any]:
        c = self.config
        return {
            "network": c.network.name,
            "fingerprint": fingerprint(c.network),
            "dtype": c.dtype,
            "optimizer": c.optimizer,
            "batch": c.batch,
            "data": c.dataset.name,
            "seed": c.seed,
        } | ({} if c.shuffle else {"shuffle": False})

    def batch_indices(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            samples = len(self.config.dataset.train)
            if self.config.shuffle:  # (an epoch's order of a million samples takes 20 ms)
                order = np.random.default_rng([self.config.seed, epoch]).permutation(samples)
            else:
                order = np.arange(samples)
            self._order = (epoch, order)
        return self._order[1][index * self.config.batch : (index + 1) * self.config.batch]

    def _outputs(self, graph: TaskGraph) -> tuple[str, str | None]:
        loss = next(t for t in graph.tasks if t.op == "softmax" and t.phase == "forward")
        evaluate = [t for t in graph.tasks if t.op == "evaluate"]
        stats = evaluate[0].requirement("output").tensor if evaluate else None
        return loss.requirement("output").tensor, stats

    @property
    def base_lr(self) -> float:
        c = self.config
        return c.hyperparameters.get("lr", OPTIMIZERS[c.optimizer]["lr"])

    def lr_scale(self, step: int) -> float:
        """The schedule's factor on the learning rate at `step`."""
        return self.config.lr_schedule.factor(step, self.total_steps)

    def step(self, step: int) -> tuple[float, np.ndarray | None]:
        train = self.config.dataset.train
        idx = self.batch_indices(step)
        graph = self.graph(len(idx))
        inputs = self._inputs(step, idx)
        ctx = StepContext(
            step,
            training=True,
            inputs=inputs,
            labels=train.y[idx],
            lr_scale=self.lr_scale(step),
        )
        self.executor.run(graph, ctx)
        self._last_batch = inputs
        loss_name, stats_name = self._outputs(graph)
        loss_value = self.executor.value(loss_name)
        loss = float(loss_value.reshape(-1)[0]) if loss_value is not None else float("nan")
        stats = None
        if stats_name:
            value = self.executor.value(stats_name)
            stats = value.reshape(-1).copy() if value is not None else np.zeros(4)
        return loss, stats

    def _inputs(self, step: int, idx: np.ndarray) -> np.ndarray | Batch:
        """Step `step`'s samples. Those of a training set read in place are read as the data
        task asks for them (this rank's rect), the next step's read ahead meanwhile
        (`runtime.data_dir`)."""
        x = self.config.dataset.train.x
        if not isinstance(x, NpyFile):
            return x[idx]
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(x)
        batch = self._prefetcher.batch(step, idx)
        if step + 1 < self.total_steps and self._last_batch is not None:
            self._prefetcher.read_ahead(step + 1, self.batch_indices(step + 1), self._last_batch)
        return batch

    def evaluate(self, split: Split) -> tuple[float, float]:
        """(mean loss, top-1 accuracy) of the forward pass over a split, in evaluation mode;
        not a number without the config's `evaluation`, as for an empty split."""
        if not self.config.evaluation:
            return float("nan"), float("nan")
        totals = np.zeros(4)
        for start in range(0, len(split), self.config.batch):
            stop = min(len(split), start + self.config.batch)
            if isinstance(split.x, NpyFile):
                x = Batch(split.x, np.arange(start, stop))
            else:
                x = split.x[start:stop]
            graph = self.graph(len(x))
            ctx = StepContext(0, training=False, inputs=x, labels=split.y[start : start + len(x)])
            self.executor.run_inference(graph, ctx)
            _, stats_name = self._outputs(graph)
            if stats_name is None:
                raise LegionNNError(f"network {self.config.network.name} has no evaluate layer")
            value = self.executor.value(stats_name)
            if value is not None:
                totals += value.reshape(-1)
        if totals[3] == 0:
            return float("nan"), float("nan")
        return totals[0] / totals[3], totals[1] / totals[3]

    def _write(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            # no number (an empty split's accuracy, a diverged loss) is JSON's null, not NaN
            record = {
                k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()
            }
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def _save(self, steps_done: int, epoch_stats: np.ndarray) -> None:
        """A checkpoint of the run after `steps_done` steps: where the data order stands (the
        epoch and the batch in it: the batches are a function of the step) and the running
        sums of the epoch's training statistics, so that the epoch's record is the same
        resumed or not."""
        c = self.config
        if not c.checkpoint_dir or self._saved == steps_done:
            return
        arrays = self.executor.resident()  # every rank takes part; rank 0 gets the arrays
        if self.executor.is_root:
            epoch, position = divmod(steps_done, self.steps_per_epoch)
            header = {
                **self.identity(),
                "step": steps_done,
                "epoch": epoch,
                "batch_in_epoch": position,
                "epoch_stats": [float(v) for v in epoch_stats],
            }
            checkpoint.save(c.checkpoint_dir, arrays, header, c.keep)
        self._saved = steps_done

    def _resume(self) -> tuple[int, np.ndarray]:
        """Load the newest checkpoint: (steps done, the epoch's statistics so far)."""
        arrays, header = checkpoint.load(self.config.checkpoint_dir, self.identity())
        try:
            self.executor.prepare(self.graph(self.config.batch), arrays)
        except NotOfThisNetwork as exc:
            raise LegionNNError(f"checkpoint: {exc}") from None
        self._saved = int(header["step"])
        stats = np.array(header.get("epoch_stats", np.zeros(4)), dtype=np.float64)
        return self._saved, stats

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            if self._prefetcher is not None:
                self._prefetcher.close()

    def _run(self) -> TrainResult:
        c = self.config
        start_step = 0
        epoch_stats = np.zeros(4)
        if c.resume:
            if not c.checkpoint_dir:
                raise LegionNNError("--resume needs --checkpoint DIR")
            start_step, epoch_stats = self._resume()
            self._write({"event": "resume", "step": start_step})
        graph = self.graph(min(c.batch, len(c.dataset.train)))
        # an imported model's parameters, unless a checkpoint's were loaded
        imported = c.network.initial if start_step == 0 and c.network.initial else None
        prepared = self.executor.prepare(graph, imported)
        if self.before_first_step:
            self.before_first_step(graph, prepared)
        losses: list[float] = []
        started = time.perf_counter()
        # What exists now (modules, Numba's compiled kernels, the graph and its program) lives
        # through the steps: frozen out of the collections the steps' garbage calls for
        with collecting_past_setup():
            self._steps(start_step, epoch_stats, losses)
        val_loss, val_accuracy = self.evaluate(c.dataset.val)
        test_loss, test_accuracy = self.evaluate(c.dataset.test)
        _, train_accuracy = self.evaluate(c.dataset.train)
        seconds = time.perf_counter() - started
        if c.save_onnx:
            arrays = self.executor.resident()  # every rank takes part; rank 0 gets the arrays
            if self.executor.is_root:
                from legion_nn.importers.onnx_export import save_onnx

                save_onnx(c.network.source, arrays, c.save_onnx)
        self._write(
            {
                "event": "done",
                "test_accuracy": test_accuracy,
                "val_accuracy": val_accuracy,
                "train_accuracy": train_accuracy,
                "test_loss": test_loss,
                "val_loss": val_loss,
                "steps": self.total_steps,
                "seconds": seconds,
            }
        )
        return TrainResult(
            losses, val_accuracy, test_accuracy, train_accuracy, self.total_steps, seconds
        )

    def _steps(self, start_step: int, epoch_stats: np.ndarray, losses: list[float]) -> None:
        """Steps `start_step` on, each loss appended to `losses`."""
        c = self.config
        for step in range(start_step, self.total_steps):
            tic = time.perf_counter()
            loss, stats = self.step(step)
            seconds = time.perf_counter() - tic
            losses.append(loss)
            if stats is not None:
                epoch_stats += stats
            epoch = step // self.steps_per_epoch
            record = {"step": step, "epoch": epoch, "seconds": seconds}
            records = self.executor.gather({**record, **self.executor.step_extras()})
            if records is not None:
                common = {"step": step, "epoch": epoch, "loss": loss}
                common["lr"] = self.base_lr * self.lr_scale(step)
                if c.clip_grad_norm is not None:
                    common["grad_norm"] = self.executor.last_grad_norm
                for rank, extras in enumerate(records):
                    self._write({**common, "rank": rank, **extras})
            if self.on_step:
                self.on_step(step, loss)
            if self.after_step:
                self.after_step(step)
            end_of_epoch = (step + 1) % self.steps_per_epoch == 0
            last = step + 1 == self.total_steps
            if end_of_epoch or last:
                self._end_epoch(epoch, epoch_stats)
            if end_of_epoch:
                epoch_stats = np.zeros(4)
            if end_of_epoch or last or self._checkpoint_due(step + 1):
                self._save(step + 1, epoch_stats)

    def _checkpoint_due(self, steps_done: int) -> bool:
        every = self.config.checkpoint_every
        return every is not None and steps_done % every == 0

    def _end_epoch(self, epoch: int, stats: np.ndarray) -> None:
        val_loss, val_accuracy = self.evaluate(self.config.dataset.val)
        train_loss = stats[0] / stats[3] if stats[3] else float("nan")
        train_accuracy = stats[1] / stats[3] if stats[3] else float("nan")
        self._write(
            {
                "event": "epoch",
                "epoch": epoch,
                "train_loss": train_loss,
                "train_accuracy": train_accuracy,
                "val_loss": val_loss,
                "val_accuracy": val_accuracy,
            }
        )
        if self.on_epoch:
            line = f"epoch {epoch + 1}: train loss {train_loss:.4f} acc {train_accuracy:.4f}"
            if self.config.evaluation:
                line += f" | val loss {val_loss:.4f} acc {val_accuracy:.4f}"
            self.on_epoch(line)
