"""Prediction: a network's forward pass over new data, on one rank of any plan.

`legion-nn predict` runs `predict_rank` on every rank of an `mpiexec` job (or as rank 0 of 1 in
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

from collections.abc import Callable, Mapping

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.network import Network
from runtime.adapters import StepContext
from runtime.rank_executor import RankExecutor
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
    for name in wanted:
        if tuple(parameters[name].shape) != graph.tensors[name].dims:
            raise LegionNNError(
                f"the checkpoint's {name} is {list(parameters[name].shape)}, the model's "
                f"{list(graph.tensors[name].dims)}"
            )
    return {name: parameters[name] for name in wanted}


def predict_rank(
    network: Network,
    x: np.ndarray,
    batch: int,
    transport: Transport,
    strategy,
    dtype: str = "float32",
    parameters: Mapping[str, np.ndarray] | None = None,
    machine=None,
    stall_timeout: float = 60.0,
    on_batch: Callable[[int], None] | None = None,
) -> np.ndarray | None:
    """The network's outputs for the samples `x` (every rank passes the same), on rank 0 (None
    elsewhere), computed `batch` samples at a time on the plan of `strategy`, from
    `parameters` (by tensor name: a checkpoint's) or else the network's own initial values."""
    graph = network.lower(batch=batch, dtype=dtype)
    name = output_tensor(network, graph)
    executor = RankExecutor(
        transport, strategy, machine, stall_timeout=stall_timeout, read_after=(name,)
    )
    executor.prepare(graph)
    executor.load_resident(_resident(graph, parameters, network))
    labels = np.zeros(network.label_dims(batch), np.int32)
    outputs = []
    for step, start in enumerate(range(0, len(x), batch)):
        chunk = x[start : start + batch]
        if len(chunk) < batch:
            padding = np.zeros((batch - len(chunk), *chunk.shape[1:]), chunk.dtype)
            chunk = np.concatenate([chunk, padding])
        executor.run_inference(
            graph, StepContext(step, training=False, inputs=chunk, labels=labels)
        )
        whole = executor.gathered(name)
        if whole is not None:
            outputs.append(whole[: min(batch, len(x) - start)])
        if on_batch is not None:
            on_batch(step)
    if transport.rank != 0:
        return None
    return np.concatenate(outputs)
