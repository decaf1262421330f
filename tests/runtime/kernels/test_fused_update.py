"""Optimizer updates fused into the kernels that compute their gradients.

The fused kernels compute each block of the gradient with the same products, in the same order,
as the kernels that store it, and step it with the same arithmetic as the update task, so a
fused step agrees with the gradient stored and then applied to within a few roundings of the
step itself; and both agree with a float64 NumPy reference to within the gradient's error bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.adapters import StepContext
from runtime.kernels import linear, reference, update
from runtime.kernels.filter_packed import backward_filter_packed
from runtime.kernels.layout import pack_activations, pack_weights
from runtime.rank_executor import RankExecutor, one_process
from runtime.step.programs import build_programs
from runtime.transport import run_threads
from tests.error_bounds import assert_close_to
from tests.runtime.kernels.test_filter import make

RULES = ("sgd", "momentum", "adam")
# (N, C, H, W, K, R, S, stride, pad, untied): clipped windows, strides, a tied filter
FILTERS = {
    "untied-stride2-asym": (2, 3, 9, 7, 4, 3, 2, 2, (1, 0, 2, 1), True),
    "untied-windows-in-padding": (2, 2, 4, 5, 2, 2, 2, 3, 3, True),
    "untied-nopad": (3, 5, 8, 9, 2, 4, 3, 1, 0, True),
    "tied-stride2": (2, 4, 7, 10, 3, 2, 3, 2, (0, 2, 1, 0), False),
}


def _state(shape, dtype, rng):
    return (
        rng.standard_normal(shape).astype(dtype),
        rng.standard_normal(shape).astype(dtype),
        rng.random(shape).astype(dtype),
    )


def _step(rule, params, s1, s2, step=3):
    if rule == "sgd":
        return update.sgd_step(params, 0.05)
    if rule == "momentum":
        return update.momentum_step(params, s1, 0.05, 0.9)
    return update.adam_step(params, s1, s2, 0.01, 0.9, 0.999, 1e-8, step)


def _agree(fused, stored, dtype):
    """The same gradient and the same arithmetic: within a few roundings of the values."""
    for got, expected in zip(fused, stored):
        eps = np.finfo(dtype).eps
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=8 * eps * scale)


def _filter_arrays(case, dtype):
    """x, dy, the weights' logical shape, stride, padding, untied, and a generator for state."""
    x, w, dy, stride, pad = make(case, dtype)
    return x, dy, w.shape, stride, pad, case[-1], np.random.default_rng(1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", FILTERS)
def test_a_filter_gradient_steps_its_weights_as_the_stored_gradient_does(name, rule, dtype):
    x, dy, logical, stride, pad, untied, rng = _filter_arrays(FILTERS[name], dtype)
    r, s = logical[4], logical[5]
    xp, dyp = pack_activations(x), pack_activations(dy)
    packed = pack_weights(np.zeros(logical, dtype)).shape
    fused = _state(packed, dtype, rng)
    stored = tuple(a.copy() for a in fused)
    args = (dyp, xp, (r, s), stride, pad, untied)
    assert backward_filter_packed(*args, step=_step(rule, *fused)) is None
    _step(rule, *stored).apply(backward_filter_packed(*args))
    _agree(fused, stored, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", FILTERS)
def test_a_fused_sgd_step_is_the_reference_gradients(name, dtype):
    x, dy, logical, stride, pad, untied, rng = _filter_arrays(FILTERS[name], dtype)
    r, s = logical[4], logical[5]
    params = pack_weights(rng.standard_normal(logical).astype(dtype))
    start = params.astype(np.float64)
    lr = 0.05
    backward_filter_packed(
        pack_activations(dy), pack_activations(x), (r, s), stride, pad, untied,
        step=update.sgd_step(params, lr),
    )  # fmt: skip
    zeros = np.zeros(logical)
    _, dw = reference.filter_backward(
        dy.astype(np.float64), x.astype(np.float64), zeros, stride, pad
    )
    _, size = reference.filter_backward(np.abs(dy), np.abs(x), zeros, stride, pad)
    terms = x.shape[0] * r * s  # the longest sum into one element of the gradient
    magnitude = np.abs(start) + lr * pack_weights(size.astype(np.float64))
    assert_close_to(params, start - lr * pack_weights(dw), magnitude, terms + 2, dtype)


def test_pieces_of_weights_step_in_the_kernel_or_through_the_gradient():
    """Position and output-channel pieces (strided views) step inside the kernel; a piece of
    input channels, whose blocks are not matrices, takes its gradient whole, then the step."""
    x, dy, logical, stride, pad, untied, rng = _filter_arrays(FILTERS["untied-nopad"], np.float64)
    xp, dyp = pack_activations(x), pack_activations(dy)
    r, s = logical[4], logical[5]
    whole = _state(pack_weights(np.zeros(logical)).shape, np.float64, rng)
    everything = (slice(None),) * 6
    pieces = {  # name: (weights' slices, the piece's dy and x, input channels)
        # positions 1:3 × 2:5 read the input rows and columns of their windows (no padding)
        "positions": ((slice(1, 3), slice(None), slice(2, 5)), dyp[1:3, 2:5],
                      xp[1 : 3 + r - 1, 2 : 5 + s - 1], None),
        "output channels": (everything[:3] + (slice(1, 2),), dyp[:, :, 1:2], xp, None),
        "input channels": (everything[:5] + (slice(1, 4),), dyp, xp, (1, 4)),
    }  # fmt: skip
    for name, (piece, dys, xs, channels) in pieces.items():
        fused = tuple(a.copy() for a in whole)
        stored = tuple(a.copy() for a in whole)
        geometry = ((r, s), stride, pad, untied, channels)
        backward_filter_packed(dys, xs, *geometry, step=_step("adam", *(a[piece] for a in fused)))
        gradient = backward_filter_packed(dys, xs, *geometry)
        _step("adam", *(a[piece] for a in stored)).apply(gradient)
        _agree(fused, stored, np.float64)
        untouched = np.ones(whole[0].shape, bool)
        untouched[piece] = False
        assert np.array_equal(fused[0][untouched], whole[0][untouched]), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", [(5, 7, 3, 4, 4), (64, 70, 2, 5, 5), (3, 700, 16, 4, 3)])
def test_a_linear_gradient_steps_its_weights_as_the_stored_gradient_does(shape, rule, dtype):
    n, m, c, h, w = shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    dy = rng.standard_normal((n, m, 1, 1)).astype(dtype)
    fused = _state((m, c, h, w), dtype, rng)
    stored = tuple(a.copy() for a in fused)
    linear.linear_weight_grad_step(dy, x, _step(rule, *fused))
    gradient = np.empty((m, c, h, w), dtype)
    linear.linear_weight_grad_accumulate(dy, x, gradient, accumulate=False)
    _step(rule, *stored).apply(gradient)
    _agree(fused, stored, dtype)


def test_weights_that_are_not_contiguous_take_the_gradient_whole():
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((4, 3, 2, 2)), rng.standard_normal((4, 5, 1, 1))
    whole = _state((5, 3, 2, 4), np.float64, rng)
    fused = tuple(a.copy() for a in whole)
    stored = tuple(a.copy() for a in whole)
    linear.linear_weight_grad_step(dy, x, _step("adam", *(a[..., 1:3] for a in fused)))
    gradient = np.empty((5, 3, 2, 2))
    linear.linear_weight_grad_accumulate(dy, x, gradient, accumulate=False)
    _step("adam", *(a[..., 1:3] for a in stored)).apply(gradient)
    _agree(fused, stored, np.float64)
    assert np.array_equal(fused[0][..., [0, 3]], whole[0][..., [0, 3]])


def _programs(strategy, nranks, fuse=True):
    graph = load_network("seed-lcn-small").lower(batch=4, optimizer="adam")
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    return graph, build_programs(graph, plan, Machine(), range(nranks), fuse_updates=fuse)


WEIGHT_UPDATES = {
    "update_L0.W": "L0.filter.grad",
    "update_L1.W": "L1.filter.grad",
    "update_W1": "classifier.linear1.grad",
}


def _fused(program):
    return {
        rt.task.name: program.tasks[rt.fused_into].task.name
        for rt in program.tasks
        if rt.fused_into is not None
    }


@pytest.mark.parametrize("strategy, nranks", [("data", 1), ("model", 2)])
def test_a_weight_whose_gradient_stays_on_its_rank_is_stepped_by_its_kernel(strategy, nranks):
    graph, programs = _programs(strategy, nranks)
    for program in programs.values():
        assert _fused(program) == WEIGHT_UPDATES
        for update_name, into in WEIGHT_UPDATES.items():
            gradient = graph.task(update_name).requirement("gradient").tensor
            assert gradient not in program.boxes  # never stored: no buffer
            producer = next(rt for rt in program.tasks if rt.task.name == into)
            update_rt = next(rt for rt in program.tasks if rt.task.name == update_name)
            assert producer.runs and not update_rt.runs
            assert list(producer.steps.values()) == [update_rt.index]
        # a bias's gradient is returned by its adapter and added: its update runs as a task
        assert graph.tensors["L1.b.grad"].name in program.boxes


def test_a_gradient_summed_across_ranks_is_stored_and_updated_after_its_collective():
    _, programs = _programs("data", 2)
    for program in programs.values():
        assert _fused(program) == {}
        assert "L1.W.grad" in program.boxes


def test_without_fusion_every_gradient_is_stored():
    _, programs = _programs("data", 1, fuse=False)
    assert _fused(programs[0]) == {} and "L1.W.grad" in programs[0].boxes


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_training_with_fused_updates_equals_training_with_stored_gradients(optimizer):
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer=optimizer)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 1, 20, 20)).astype(np.float32)
    y = rng.integers(0, 10, 8).astype(np.int32)
    fused, stored = one_process(5), one_process(5, keep_step_tensors=True)
    for executor in (fused, stored):
        for step in range(3):
            executor.run(graph, StepContext(step, inputs=x, labels=y))
    assert _fused(fused.prepare(graph).step) == WEIGHT_UPDATES
    assert _fused(stored.prepare(graph).step) == {}
    got, expected = fused.resident(), stored.resident()
    assert set(got) == set(expected)
    for name in expected:
        _agree((got[name],), (expected[name],), np.float32)
    initial = one_process(5)
    initial.prepare(graph)
    assert not np.array_equal(got["L1.W"], initial.resident()["L1.W"])  # the steps ran


def test_a_tied_filter_keeps_its_gradient_a_linear_layer_beside_it_does_not():
    """A tied filter's gradient is summed over every position before any of it is final: its
    kernel cannot step the weights block by block, so its update stays a task of its own."""
    graph = load_network("three-layer-convnet").lower(batch=4, optimizer="adam")
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    (program,) = build_programs(graph, plan, Machine(), [0]).values()
    assert _fused(program) == {"update_W2": "fc3.linear2.grad", "update_W1": "fc2.linear1.grad"}
    assert "conv1.W.grad" in program.boxes


def test_model_parallel_training_with_fused_updates_equals_training_with_stored_gradients():
    """Two ranks, each updating its output channels of every weight inside the kernel of its
    gradient, against the same two ranks storing the gradients and updating after."""
    cfg_graph = load_network("seed-lcn-small").lower(batch=8, optimizer="adam")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 1, 20, 20)).astype(np.float32)
    y = rng.integers(0, 10, 8).astype(np.int32)

    def body(keep):
        def run(transport):
            executor = RankExecutor(transport, "model", seed=5, keep_step_tensors=keep)
            for step in range(3):
                executor.run(cfg_graph, StepContext(step, inputs=x, labels=y))
            return _fused(executor.prepare(cfg_graph).step), executor.resident()

        return run_threads(2, run)

    fused, stored = body(False), body(True)
    assert [f for f, _ in fused] == [WEIGHT_UPDATES] * 2
    assert [f for f, _ in stored] == [{}] * 2
    got, expected = fused[0][1], stored[0][1]
    assert set(got) == set(expected)
    for name in expected:
        _agree((got[name],), (expected[name],), np.float32)
