"""Prediction: a network's forward pass over new data, on one rank of any plan.

`legion-nn predict` runs `Predictor.outputs` on every rank of an `mpiexec` job (or as rank 0 of 1 in
one process). The step is the training step's graph at the prediction batch, planned by the
strategy as training plans it; each batch runs its forward pass alone (`run_inference`:
dropout passes its input through, batch normalisation uses its running statistics), and the
output tensor, wherever the plan left its parts, is assembled on rank 0 (`gathered`). That
tensor lives to the end of the step (`read_after`) rather than to its last reader.

The output is the model's own: a model whose softmax was appended to train it (an ONNX model
that outputs logits) yields the scores the softmax reads, any other the probabilities it writes.
A last batch shorter than the others is padded with zero samples and its rows dropped: in
inference each sample's output depends on that sample alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.network import Network
from runtime.adapters import StepContext
from runtime.rank_executor import NotOfThisNetwork, RankExecutor
from runtime.transport import Transport


def output_tensor(network: Network, graph: TaskGraph) -> str:
    """The tensor holding the network's output in `graph`: the last softmax's probabilities,
    or, where that softmax was appended for training, the scores it reads."""
    softmax = [t for t in graph.tasks if t.op == "softmax" and t.phase == "forward"][-1]
    role = "input" if network.appended_loss else "probability"
    return next(r.tensor for r in softmax.requirements if r.role == role)


def _resident(
    graph: TaskGraph, parameters: Mapping[str, np.ndarray] | None, network: Network
) -> dict[str, np.ndarray]:
    """The values to start from: a checkpoint's parameters and state (every one the graph
    holds; an optimizer's state it does not lower is left out), or the network's own."""
    if parameters is None:
        return dict(network.initial)
    wanted = [n for n, t in graph.tensors.items() if t.kind in ("param", "state")]
    missing = [n for n in wanted if n not in parameters]
    if missing:
        raise LegionNNError(f"the checkpoint holds no {missing[0]} ({len(missing)} missing)")
    return {name: parameters[name] for name in wanted}


class Predictor:
    """The forward pass of `network` at `batch` on this rank of the plan of `strategy`, from
    `parameters` (by tensor name: a checkpoint's) or else the network's own initial values:
    planned, placed and loaded once, then run batch by batch."""

    def __init__(
        self,
        network: Network,
        batch: int,
        transport: Transport,
        strategy,
        dtype: str = "float32",
        parameters: Mapping[str, np.ndarray] | None = None,
        machine=None,
        stall_timeout: float = 60.0,
    ) -> None:
        self.batch = batch
        self.graph = network.lower(batch=batch, dtype=dtype)
        self.output = output_tensor(network, self.graph)
        self.executor = RankExecutor(
            transport, strategy, machine, stall_timeout=stall_timeout, read_after=(self.output,)
        )
        try:  # a shape the model does not have: one line naming the tensor
            self.executor.prepare(self.graph, _resident(self.graph, parameters, network))
        except NotOfThisNetwork as exc:
            raise LegionNNError(f"checkpoint: {exc}") from None
        self.labels = np.zeros(network.label_dims(batch), np.int32)
        self.steps = 0

    def run(self, chunk: np.ndarray) -> None:
        """The forward pass of `batch` samples, its output left on the ranks that hold it."""
        context = StepContext(self.steps, training=False, inputs=chunk, labels=self.labels)
        self.executor.run_inference(self.graph, context)
        self.steps += 1

    def __call__(self, chunk: np.ndarray) -> np.ndarray | None:
        """The outputs of up to `batch` samples, on rank 0 (None elsewhere): a shorter chunk is
        padded with zero samples, and their rows dropped."""
        count = len(chunk)
        if count < self.batch:
            padding = np.zeros((self.batch - count, *chunk.shape[1:]), chunk.dtype)
            chunk = np.concatenate([chunk, padding])
        self.run(chunk)
        whole = self.executor.gathered(self.output)
        return None if whole is None else whole[:count]

    def outputs(self, x: np.ndarray) -> np.ndarray | None:
        """The network's outputs for the samples `x` (every rank passes the same), on rank 0
        (None elsewhere), computed `batch` samples at a time."""
        found = [self(x[start : start + self.batch]) for start in range(0, len(x), self.batch)]
        return None if found[0] is None else np.concatenate(found)
