"""The executor runs the task graph itself (one rank, in one process, as `legion-nn train` runs
it): gradients, pieces, sparse updates, inference."""

import numpy as np
import pytest

from legion_nn.graph import inference_tasks
from legion_nn.layers import (
    Add,
    AvgPool,
    BatchNorm,
    Concat,
    Conv,
    Dropout,
    Evaluate,
    Filter,
    FilterA,
    FilterNL,
    Flatten,
    Linear,
    MaxPool,
    Softmax,
)
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.op_records import reduction_dims, splittable_dims
from legion_nn.privilege import Privilege
from runtime.adapters import StepContext
from runtime.piece_views import run_task_piece
from runtime.rank_executor import one_process

#: a step whose update leaves every parameter as it was: forward, zeroing and backward only
FROZEN = {"optimizer": "sgd", "hyperparameters": {"lr": 0.0}}


def batch_for(net, n, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + tuple(net.input))
    y = rng.integers(0, net.classes, n).astype(np.int32)
    return x, y


def loss_and_grads(executor, graph, x, y, step=0):
    """Run a step of a `FROZEN` graph (the update leaves the parameters); return the loss."""
    ctx = StepContext(step, inputs=x, labels=y)
    executor.run(graph, ctx)
    loss = next(t for t in graph.tasks if t.op == "softmax" and t.phase == "forward")
    return float(executor.arrays[loss.requirement("output").tensor].reshape(-1)[0])


def rel_error(a, b):
    return np.max(np.abs(a - b) / np.maximum(1e-8, np.abs(a) + np.abs(b)))


MIXED = Network(
    "mixed",
    (2, 9, 9),
    3,
    [
        Conv("c0", out_channels=3, kernel=3, pad=1, stride=1, bias=False),  # batchnorm follows
        BatchNorm("bn0"),
        FilterNL(fn="tanh"),
        MaxPool("p0", kernel=3, stride=2),
        Filter("L1", out_channels=4, kernel=2, untied=True, stride=1, pad=[1, 0, 0, 1]),
        FilterA(),
        FilterNL(fn="sigmoid"),
        Dropout("d1", ratio=0.3, seed=5),
        Flatten("f"),
        BatchNorm("bn1", spatial=False),
        Linear("fc", out=3, bias=True),
        Softmax(),
        Evaluate(),
    ],
)


#: branches: a residual block (its shortcut the block's input), a side branch from inside the
#: block, and a concat of three groups, one of them the network's input (which needs no gradient)
RESIDUAL = Network(
    "residual",
    (2, 6, 6),
    3,
    [
        Conv("c0", out_channels=4, kernel=3, pad=1),
        FilterNL("r0", fn="tanh"),
        Conv("c1", out_channels=4, kernel=3, pad=1, bias=False),  # batchnorm follows
        BatchNorm("bn1"),
        FilterNL("r1", fn="tanh"),
        Conv("c2", out_channels=4, kernel=3, pad=1),
        Add("res", inputs=["c2", "r0"]),
        FilterNL("r2", fn="sigmoid"),
        Conv("side", out_channels=2, kernel=1, inputs=["r0"]),
        Concat("cat", inputs=["r2", "side", "data"]),
        MaxPool("p", kernel=2, stride=2),
        Flatten("f"),
        Linear("fc", out=3, bias=True),
        Softmax(),
        Evaluate(),
    ],
)


def whole_network_gradient_check(net, batch, samples, seed=0):
    graph = net.lower(batch=batch, dtype="float64", **FROZEN)
    executor = one_process(seed, keep_step_tensors=True)  # it reads the gradients
    x, y = batch_for(net, batch)
    loss_and_grads(executor, graph, x, y)
    rng = np.random.default_rng(2)
    worst = {}
    params = [t for t in graph.tensors.values() if t.kind == "param"]
    analytic = {p.name: executor.arrays[f"{p.name}.grad"].copy() for p in params}
    for param in params:
        values = executor.arrays[param.name]
        flat = values.reshape(-1)
        picks = rng.choice(flat.size, size=min(samples, flat.size), replace=False)
        errors = []
        for index in picks:
            old = flat[index]
            step = 1e-6
            flat[index] = old + step
            plus = loss_and_grads(executor, graph, x, y)
            flat[index] = old - step
            minus = loss_and_grads(executor, graph, x, y)
            flat[index] = old
            numeric = (plus - minus) / (2 * step)
            got = analytic[param.name].reshape(-1)[index]
            errors.append(abs(numeric - got) / max(1e-8, abs(numeric) + abs(got)))
        worst[param.name] = max(errors)
    return worst


@pytest.mark.parametrize("name", ["seed-lcn-small", "three-layer-convnet"])
def test_whole_network_gradients(name):
    worst = whole_network_gradient_check(load_network(name), batch=2, samples=6)
    for param, error in worst.items():
        # seed 002: below 1e-5, conv weights up to 1e-2 (their sums are long and kinked by relu)
        bound = 1e-2 if param.endswith(".W") else 1e-5
        assert error < bound, (param, error)


def test_every_op_in_one_network_has_correct_gradients():
    worst = whole_network_gradient_check(MIXED, batch=3, samples=5)
    for param, error in worst.items():
        assert error < 1e-5, (param, error)


def test_a_residual_network_with_a_concat_has_correct_gradients():
    """Both inputs of an add and every input of a concat get their gradients, and a tensor read
    by two layers (the block's input) gets the sum of both."""
    worst = whole_network_gradient_check(RESIDUAL, batch=3, samples=6)
    assert set(worst) >= {"c0.W", "c1.W", "c2.W", "side.W", "fc.weights1"}
    for param, error in worst.items():
        assert error < 1e-5, (param, error)


def run_in_pieces(graph, executor, ctx):
    """Run every task as a grid of pieces (each splittable dim cut in two where it can be); a
    grid cutting a dim the task sums over makes its pieces add partial sums into its output,
    zeroed first."""
    executor.prepare(graph)
    for task in graph.tasks:
        grid = [1] * task.space.ndim
        for dim in splittable_dims(task):
            if task.space.shape[dim] >= 2:
                grid[dim] = 2
        partial = any(grid[d] > 1 for d in reduction_dims(task))
        if partial:
            for req in task.requirements:
                if req.privilege is Privilege.WRITE:
                    executor.view(req.tensor, req.write_rect)[...] = 0
        for piece in task.space.split(grid):
            if not piece.is_empty():
                run_task_piece(task, piece, graph.tensors, executor.view, ctx, partial)


#: a sparse weight update (seed 003) of input channels [1, 3) of 4: cut in halves, each piece's
#: input channels hold one of them
SPARSE = Network(
    "sparse",
    (4, 6, 6),
    2,
    [
        Filter("L0", out_channels=3, kernel=3, untied=True, update_channels=[1, 3]),
        FilterNL(fn="relu"),
        Linear("c", out=2),
        Softmax(),
    ],
)


#: average pooling, padded, over a convolution's output (ONNX's AveragePool)
POOLED = Network(
    "pooled",
    (2, 7, 7),
    3,
    [
        Conv("c", out_channels=3, kernel=3, pad=1),
        FilterNL(fn="tanh"),
        AvgPool("p", kernel=3, stride=2, pad=1),
        Linear("fc", out=3, bias=True),
        Softmax(),
        Evaluate(),
    ],
)


def test_average_pooling_has_correct_gradients():
    worst = whole_network_gradient_check(POOLED, batch=2, samples=5)
    for param, error in worst.items():
        assert error < 1e-5, (param, error)


@pytest.mark.parametrize(
    "net",
    [MIXED, load_network("seed-lcn-small"), SPARSE, POOLED, RESIDUAL],
    ids=["mixed", "lcn", "sparse", "pooled", "residual"],
)
def test_pieces_compute_what_the_whole_computes(net):
    graph = net.lower(batch=4, dtype="float64", optimizer="momentum")
    x, y = batch_for(net, 4)
    whole, pieces = (one_process(3, keep_step_tensors=True) for _ in range(2))
    for step in range(2):
        whole.run(graph, StepContext(step, inputs=x, labels=y))
        run_in_pieces(graph, pieces, StepContext(step, inputs=x, labels=y))
    for name in graph.tensors:
        np.testing.assert_allclose(
            pieces.arrays[name], whole.arrays[name], rtol=1e-9, atol=1e-12, err_msg=name
        )


def test_sparse_update_changes_only_the_selected_channels():
    net = SPARSE
    graph = net.lower(batch=2, dtype="float64", hyperparameters={"lr": 0.5})
    executor = one_process(0)
    x, y = batch_for(net, 2)
    executor.prepare(graph)
    before = executor.value("L0.W").copy()
    executor.run(graph, StepContext(0, inputs=x, labels=y))
    after = executor.value("L0.W")
    np.testing.assert_array_equal(after[:, :, :, [0, 3]], before[:, :, :, [0, 3]])
    assert np.all(np.any(after[:, :, :, 1:3] != before[:, :, :, 1:3], axis=(0, 1, 2)))


def test_inference_runs_no_backward_and_leaves_parameters_alone():
    net = load_network("seed-lcn-small")
    graph = net.lower(batch=3)
    executor = one_process(0)
    x, y = batch_for(net, 3)
    executor.prepare(graph)
    before = {k: v.copy() for k, v in executor.resident().items()}
    tasks = inference_tasks(graph)
    assert {t.phase for t in tasks} == {"forward", "set_zero"}
    ctx = executor.run_inference(graph, StepContext(0, training=False, inputs=x, labels=y))
    # labels that the model's own predictions get right in rows 0 and 2 and wrong in row 1
    predicted = np.argmax(executor.value("classifier.softmax.probability").reshape(3, -1), 1)
    y = predicted.astype(np.int32)
    y[1] = (y[1] + 1) % net.classes
    ctx = executor.run_inference(graph, StepContext(1, training=False, inputs=x, labels=y))
    assert ctx.futures["classifier.evaluate.accuracy"] == pytest.approx(2 / 3, abs=1e-12)
    for name, value in executor.resident().items():
        np.testing.assert_array_equal(value, before[name])
    stats = executor.arrays["classifier.evaluate.output"].reshape(-1)
    assert stats[1] == 2 and stats[3] == 3 and stats[2] >= stats[1]


def test_inference_normalises_with_the_running_statistics_without_computing_the_batchs(
    monkeypatch,
):
    graph = MIXED.lower(batch=3, dtype="float64")
    executor = one_process(0)
    x, y = batch_for(MIXED, 3)
    executor.prepare(graph)
    executor.run_inference(graph, StepContext(0, training=False, inputs=x, labels=y))
    expected = executor.value("fc.softmax.probability").copy()
    from runtime.kernels import batchnorm

    def refused(*args):
        raise AssertionError("the batch's statistics were computed in evaluation")

    monkeypatch.setattr(batchnorm, "batchnorm_stats", refused)
    executor.run_inference(graph, StepContext(1, training=False, inputs=x, labels=y))
    np.testing.assert_array_equal(executor.value("fc.softmax.probability"), expected)
