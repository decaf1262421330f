"""Sequence tensors (N, T, D): the embedding, dense and layernorm layers, elementwise ops and the
token-level loss; their kernels against NumPy and central differences in float64, a network of
them against central differences end to end, and split over ranks against one process.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.networks import gpt, token_mlp
from legion_nn.spec import network_from_dict
from partitioner.machine import Machine
from partitioner.search.auto import auto
from partitioner.strategy import builtin, find_units
from runtime import token_data
from runtime.kernels.attention import (
    matmul_backward,
    matmul_forward,
    row_softmax_backward,
    row_softmax_forward,
)
from runtime.kernels.dense import dense_backward, dense_forward
from runtime.kernels.embedding import embedding_backward, embedding_forward
from runtime.kernels.gelu import gelu_forward
from runtime.kernels.layernorm import layernorm_backward, layernorm_forward
from runtime.kernels.nonlinear import filterNL_backward, filterNL_forward
from runtime.training import TrainConfig, Trainer
from tests.error_bounds import assert_close_to, assert_product_close
from tests.runtime.test_rank_executor import assert_same, local_run, ranks_run

RNG = np.random.default_rng(11)


def central_difference(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + h
        up = f()
        x[index] = saved - h
        down = f()
        x[index] = saved
        grad[index] = (up - down) / (2 * h)
    return grad


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), np.abs(b).max(), 1e-12))


def test_embedding_gathers_rows_and_scatters_their_gradient():
    weights = RNG.standard_normal((7, 5))
    ids = RNG.integers(0, 7, (3, 4)).astype(np.int32)
    np.testing.assert_array_equal(embedding_forward(ids, weights), weights[ids])
    dy = RNG.standard_normal((3, 4, 5))
    expected = np.zeros_like(weights)
    np.add.at(expected, ids, dy)
    counts = np.bincount(ids.ravel(), minlength=7)[:, None]
    magnitude = np.zeros_like(weights)
    np.add.at(magnitude, ids, np.abs(dy))
    assert_close_to(embedding_backward(ids, dy, 7), expected, magnitude, int(counts.max()))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 7\)"):
        embedding_forward(np.array([[7]], np.int32), weights)


def test_dense_products_are_within_their_error_bound():
    x, w, b = RNG.standard_normal((3, 4, 6)), RNG.standard_normal((6, 5)), RNG.standard_normal(5)
    y = dense_forward(x, w, b)
    assert_product_close(y.reshape(12, 5), x.reshape(12, 6), w, offset=b)
    dy = RNG.standard_normal((3, 4, 5))
    dx, dw, db = dense_backward(dy, x, w, need_dx=True, need_db=True)
    assert_product_close(dx.reshape(12, 6), dy.reshape(12, 5), w.T)
    assert_product_close(dw, x.reshape(12, 6).T, dy.reshape(12, 5))
    assert_close_to(db, dy.sum(axis=(0, 1)), np.abs(dy).sum(axis=(0, 1)), 12)
    with pytest.raises(ValueError, match="does not match x shape"):
        dense_forward(x, w.T)


def test_dense_gradients_go_straight_into_their_buffers():
    """Given buffers, the products write there, or add to what they hold: a gradient summed
    over pieces or micro-batches needs no temporary of its size."""
    x, w = RNG.standard_normal((3, 4, 6)), RNG.standard_normal((6, 5))
    dy = RNG.standard_normal((3, 4, 5))
    held_dw, held_dx = RNG.standard_normal((6, 5)), RNG.standard_normal((3, 4, 6))
    dw, dx = held_dw.copy(), held_dx.copy()
    got_dx, got_dw, _ = dense_backward(dy, x, w, dw=dw, add_dw=True, dx=dx, add_dx=True)
    assert got_dw is dw and got_dx is dx
    assert_product_close(dw, x.reshape(12, 6).T, dy.reshape(12, 5), offset=held_dw)
    assert_product_close(dx.reshape(12, 6), dy.reshape(12, 5), w.T, offset=held_dx.reshape(12, 6))
    dense_backward(dy, x, w, dw=dw, dx=dx)  # written over
    assert_product_close(dw, x.reshape(12, 6).T, dy.reshape(12, 5))
    y = np.full((3, 4, 5), np.nan)
    assert dense_forward(x, w, out=y) is y
    assert_product_close(y.reshape(12, 5), x.reshape(12, 6), w)
    held_y, b = RNG.standard_normal((3, 4, 5)), RNG.standard_normal(5)
    y = held_y.copy()
    dense_forward(x, w, b, out=y, add=True)  # a partial sum over part of the inputs
    assert_product_close(y.reshape(12, 5), x.reshape(12, 6), w, offset=(held_y + b).reshape(12, 5))
    with pytest.raises(ValueError, match="C-contiguous"):
        dense_backward(dy, x, w, dw=np.zeros((5, 6)).T)


def layernorm_reference(x, gamma, beta, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def test_layernorm_matches_numpy_and_central_differences():
    x = RNG.standard_normal((2, 3, 5)) * 3 + 1
    gamma, beta = RNG.standard_normal(5), RNG.standard_normal(5)
    eps = 1e-5
    expected = layernorm_reference(x, gamma, beta, eps)
    np.testing.assert_allclose(layernorm_forward(x, gamma, beta, eps), expected, rtol=0, atol=1e-13)
    r = RNG.standard_normal(x.shape)

    def loss() -> float:
        return float((layernorm_forward(x, gamma, beta, eps) * r).sum())

    dx, dgamma, dbeta = layernorm_backward(r, x, gamma, eps)
    assert relative_error(dx, central_difference(loss, x)) < 1e-7
    assert relative_error(dgamma, central_difference(loss, gamma)) < 1e-7
    assert relative_error(dbeta, central_difference(loss, beta)) < 1e-7
    none, dgamma_alone, _ = layernorm_backward(r, x, gamma, eps, need_dx=False)
    assert none is None and np.array_equal(dgamma_alone, dgamma)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_elementwise_kernels_take_any_rank_up_to_four(shape):
    x = RNG.standard_normal(shape)
    four = x.reshape((1,) * (4 - x.ndim) + shape)
    assert np.array_equal(gelu_forward(x), gelu_forward(four).reshape(shape))
    y = filterNL_forward(x, "tanh")
    assert y.shape == shape and np.array_equal(y, filterNL_forward(four, "tanh").reshape(shape))
    dy = RNG.standard_normal(shape)
    dx = filterNL_backward(dy, y, "tanh")
    expected = filterNL_backward(dy.reshape(four.shape), y.reshape(four.shape), "tanh")
    assert dx.shape == shape and np.array_equal(dx, expected.reshape(shape))


def tiny_lm(**extra) -> TrainConfig:
    network = token_mlp(length=6, width=4, vocab=9)
    dataset = token_data.synthetic(6, 9, seed=2, rows=40)
    return TrainConfig(
        network=network,
        dataset=dataset,
        batch=5,
        dtype="float64",
        seed=4,
        optimizer="sgd",
        shuffle=False,
        **extra,
    )


def test_the_loss_is_the_mean_over_tokens():
    cfg = tiny_lm(hyperparameters={"lr": 0.0})
    trainer = Trainer(cfg)
    trainer.executor.prepare(trainer.graph(5))
    loss, stats = trainer.step(0)
    assert stats[3] == 5 * 6  # every token of the batch counted once
    assert loss == pytest.approx(stats[0] / stats[3], rel=1e-12)


@pytest.mark.parametrize(
    ("strategy", "nranks"), [("data", 2), ("model", 2), ("spatial", 3), ("model", 4)]
)
def test_a_language_model_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = tiny_lm()
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


def test_builtin_strategies_cut_sequences_by_the_roles_of_their_dims():
    graph = token_mlp(length=8, width=8, vocab=16).lower(batch=4)
    units = {u.name: u for u in find_units(graph)}
    model = builtin(graph, "model", 4).unit_grids
    spatial = builtin(graph, "spatial", 4).unit_grids
    assert model["mlp_in"] == (1, 1, 4, 1)  # column-parallel: the output features
    assert model["embed"] == (1, 1, 4)
    assert model["ln1"] == (4, 1, 1)  # a token's features stay whole: the batch instead
    assert spatial["mlp_in"] == (1, 4, 1, 1) and spatial["ln1"] == (1, 4, 1)  # the tokens
    assert units["mlp_in"].axes == "NSF-"


def test_layers_refuse_inputs_of_the_wrong_rank():
    spec = {
        "name": "bad",
        "input": [8],
        "classes": 4,
        "layers": [{"kind": "embedding", "vocab": 4, "dim": 3}, {"kind": "linear", "out": 4}],
    }
    with pytest.raises(LegionNNError, match=r"\(linear\): takes images \[C, H, W\].*got \[8, 3\]"):
        network_from_dict(spec, "bad.json")


def test_text_makes_windows_with_next_byte_targets(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(200)) * 2)
    dataset = token_data.from_text(str(text), 16, 256, 256)
    cut = 400 - 40
    assert len(dataset.train) == (cut - 1) // 16 and len(dataset.val) == (40 - 1) // 16
    x, y = dataset.train.x, dataset.train.y
    assert x.dtype == np.int32 and np.array_equal(y[:, :-1], x[:, 1:])
    assert x[1, 0] == 16 and y[0, -1] == 16


def test_a_token_beyond_the_vocabulary_is_named_by_row(tmp_path):
    path = tmp_path / "ids.npz"
    x = np.zeros((4, 6), np.int64)
    x[2, 3] = 9
    np.savez(path, x_train=x, y_train=np.zeros((4, 6), np.int64))
    with pytest.raises(LegionNNError, match=r"x_train row 2 holds token id 9 at position 3"):
        token_data.from_npz(str(path), 6, 9, 9)


def test_products_of_two_activations_are_within_their_error_bound():
    a, b = RNG.standard_normal((2, 3, 4, 5)), RNG.standard_normal((2, 3, 6, 5))
    out = matmul_forward(a, b, transpose_b=True, scale=0.5)
    for n, h in np.ndindex(2, 3):
        assert_product_close(out[n, h], 0.5 * a[n, h], b[n, h].T)
    dy = RNG.standard_normal(out.shape)
    da, db = matmul_backward(dy, a, b, transpose_b=True, scale=0.5)
    for n, h in np.ndindex(2, 3):
        assert_product_close(da[n, h], 0.5 * dy[n, h], b[n, h])
        assert_product_close(db[n, h], 0.5 * dy[n, h].T, a[n, h])
    c = RNG.standard_normal((2, 3, 5, 6))
    dy = RNG.standard_normal((2, 3, 4, 6))
    da, dc = matmul_backward(dy, a, c)
    for n, h in np.ndindex(2, 3):
        assert_product_close(matmul_forward(a, c)[n, h], a[n, h], c[n, h])
        assert_product_close(da[n, h], dy[n, h], c[n, h].T)
        assert_product_close(dc[n, h], a[n, h].T, dy[n, h])


@pytest.mark.parametrize("transpose_b", [False, True])
def test_products_written_in_place_or_added_equal_those_returned(transpose_b):
    a = RNG.standard_normal((2, 3, 4, 5))
    b = RNG.standard_normal((2, 3, 6, 5) if transpose_b else (2, 3, 5, 6))
    alone = matmul_forward(a, b, transpose_b, 0.3)
    out = np.full_like(alone, np.nan)
    assert matmul_forward(a, b, transpose_b, 0.3, out=out) is out
    np.testing.assert_array_equal(out, alone)
    held = RNG.standard_normal(alone.shape)
    out = held.copy()
    matmul_forward(a, b, transpose_b, 0.3, out=out, add=True)
    dy = RNG.standard_normal(alone.shape)
    da, db = matmul_backward(dy, a, b, transpose_b, 0.3)
    held_a, held_b = RNG.standard_normal(a.shape), RNG.standard_normal(b.shape)
    into_a, into_b = held_a.copy(), held_b.copy()
    got = matmul_backward(
        dy, a, b, transpose_b, 0.3, da=into_a, add_da=True, db=into_b, add_db=True
    )
    assert got[0] is into_a and got[1] is into_b
    for n, h in np.ndindex(2, 3):
        right = b[n, h].T if transpose_b else b[n, h]
        # each product summed onto what its buffer held: within the product's own bound
        assert_product_close(out[n, h], 0.3 * a[n, h], right, held[n, h])
        assert_product_close(into_a[n, h], dy[n, h], 0.3 * right.T, held_a[n, h])
        left, other = (dy[n, h].T, 0.3 * a[n, h]) if transpose_b else (0.3 * a[n, h].T, dy[n, h])
        assert_product_close(into_b[n, h], left, other, held_b[n, h])
    fresh_a, fresh_b = np.full_like(da, np.nan), np.full_like(db, np.nan)
    matmul_backward(dy, a, b, transpose_b, 0.3, need_db=False, da=fresh_a)
    matmul_backward(dy, a, b, transpose_b, 0.3, need_da=False, db=fresh_b)
    np.testing.assert_array_equal(fresh_a, da)
    np.testing.assert_array_equal(fresh_b, db)


@pytest.mark.parametrize("transpose_b", [False, True])
def test_products_read_strided_heads_where_they_lie(transpose_b):
    """Operands as `split_heads` makes them (strided views of (N, T, H·D) features), reversed
    (a negative stride, read from a copy), broadcast over heads or with spaced rows (read from
    a copy) equal their C-contiguous copies bit for bit: the GEMM sums each element in one
    order wherever its operands lie."""

    def heads(features):
        n, t, width = features.shape
        return features.reshape(n, t, 3, width // 3).transpose(0, 2, 1, 3)

    a = heads(RNG.standard_normal((2, 4, 15)))
    b = heads(RNG.standard_normal((2, 6, 15)))
    if not transpose_b:
        b = b.transpose(0, 1, 3, 2)[:, :, :, :4]
    reversed_a = a[:, :, ::-1]
    broadcast_b = np.broadcast_to(b[:, :1], b.shape)
    spaced_b = np.repeat(b, 2, axis=-1)[..., ::2]  # rows of stride 2: copied for the GEMM
    for left, right in ((a, b), (reversed_a, b), (a, broadcast_b), (a, spaced_b)):
        assert not (left.flags.c_contiguous and right.flags.c_contiguous)
        copies = np.ascontiguousarray(left), np.ascontiguousarray(right)
        out = matmul_forward(left, right, transpose_b, 0.3)
        np.testing.assert_array_equal(out, matmul_forward(*copies, transpose_b, 0.3))
        dy = heads(RNG.standard_normal((2, out.shape[2], 3 * out.shape[3])))
        got = matmul_backward(dy, left, right, transpose_b, 0.3)
        want = matmul_backward(np.ascontiguousarray(dy), *copies, transpose_b, 0.3)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    for n, h in np.ndindex(2, 3):
        right = b[n, h].T if transpose_b else b[n, h]
        assert_product_close(matmul_forward(a, b, transpose_b)[n, h], a[n, h], right)


@pytest.mark.parametrize("first_row", [0, 2])
def test_causal_row_softmax_matches_numpy_and_central_differences(first_row):
    x = RNG.standard_normal((2, 2, 3, 6)) * 2
    y = row_softmax_forward(x, causal=True, first_row=first_row)
    keep = np.arange(6)[None, :] <= (first_row + np.arange(3))[:, None]
    masked = np.where(keep, x, -np.inf)
    expected = np.exp(masked - masked.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, expected, rtol=1e-14, atol=0)
    assert np.all(y[..., ~keep] == 0)
    r = RNG.standard_normal(x.shape)

    def loss() -> float:
        return float((row_softmax_forward(x, True, first_row) * r).sum())

    assert relative_error(row_softmax_backward(r, y), central_difference(loss, x)) < 1e-7


def tiny_gpt(**extra) -> TrainConfig:
    network = gpt(length=4, width=8, heads=2, blocks=1, vocab=7)
    return TrainConfig(
        network=network,
        dataset=token_data.synthetic(4, 7, seed=2, rows=30),
        batch=3,
        dtype="float64",
        seed=4,
        optimizer="sgd",
        shuffle=False,
        **extra,
    )


@pytest.mark.parametrize("make", [tiny_lm, tiny_gpt])
def test_a_language_model_step_follows_central_differences(make):
    """One SGD step of lr 1 moves every parameter by its gradient; the token-level mean
    cross-entropy, as a function of a few entries of each parameter, agrees with it."""
    trainer = Trainer(make(hyperparameters={"lr": 1.0}))
    batch = trainer.config.batch
    trainer.executor.prepare(trainer.graph(batch))
    before = {k: v.copy() for k, v in trainer.executor.resident().items()}
    trainer.step(0)
    after = trainer.executor.resident()
    probe = Trainer(make(hyperparameters={"lr": 0.0}))
    probe.executor.prepare(probe.graph(batch))
    h = 1e-6
    for name, value in before.items():
        for index in list(np.ndindex(value.shape))[:: max(1, value.size // 3)]:
            losses = []
            for sign in (1, -1):
                moved = {k: v.copy() for k, v in before.items()}
                moved[name][index] += sign * h
                probe.executor.load_resident(moved)
                losses.append(probe.step(0)[0])
            numeric = (losses[0] - losses[1]) / (2 * h)
            analytic = value[index] - after[name][index]
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (name, index)


@pytest.mark.parametrize(
    ("strategy", "nranks"), [("data", 2), ("model", 2), ("model", 3), ("spatial", 4), ("auto", 4)]
)
def test_a_gpt_split_over_ranks_equals_one_process(strategy, nranks):
    """3 ranks cut 8 features into 3, 3 and 2: the merged heads are cut inside a head."""
    cfg = tiny_gpt()
    if strategy == "auto":
        strategy = lambda graph, ranks: auto(graph, ranks, Machine(), 10.0).strategy
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 4)])
def test_a_gpt_in_stages_with_deferred_weight_gradients_equals_one_process(strategy, nranks):
    """2 stages of 3 micro-batches of a sample each: the dense layers' weight gradients are
    computed once a stage over every micro-batch's tokens, written or added in place."""
    full = local_run(tiny_gpt())
    cfg = tiny_gpt(stages=2, micro_batches=3, schedule="1f1b-deferred")
    graph = Trainer(cfg).graph(cfg.batch)
    deferred = [t for t in graph.tasks if "micro_rows" in t.attrs]
    assert "dense" in {t.op for t in deferred}
    assert_same(full, ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize(("grid", "nranks"), [((1, 1, 1, 2), 2), ((1, 1, 2, 2), 4)])
def test_dense_layers_split_over_their_inputs_equal_one_process(grid, nranks):
    """Each dense layer's features cut (its reduction dim): every piece adds its partial sums
    of the outputs, straight into their buffers, as the gradients do."""

    def reduction_split(graph, ranks):
        data = builtin(graph, "data", ranks)
        dense = {u.name for u in find_units(graph) if graph.task(u.forward[0]).op == "dense"}
        grids = {unit: grid if unit in dense else cells for unit, cells in data.unit_grids.items()}
        assert len(dense) == 7  # q, k, v, proj, fc, fc_out and the head
        return replace(data, name="dense-rows", unit_grids=grids)

    cfg = tiny_gpt()
    assert_same(local_run(cfg), ranks_run(cfg, nranks, reduction_split))


def test_megatron_splits_attention_by_heads():
    graph = gpt(length=8, width=16, heads=4, blocks=1, vocab=11).lower(batch=2)
    model = builtin(graph, "model", 4).unit_grids
    assert model["b0_q"] == (1, 1, 4, 1)  # QKV column-parallel
    assert model["b0_qh"] == (1, 4, 1, 1) and model["b0_attn"] == (1, 4, 1, 1)  # by heads
    assert model["b0_scores"] == (1, 4, 1, 1, 1)
    spatial = builtin(graph, "spatial", 4).unit_grids
    assert spatial["b0_scores"] == (1, 1, 4, 1, 1)  # the queries' positions


def test_auto_finds_megatrons_splits_of_a_gpt_block(tmp_path):
    """One GPT block at batch 1 on 8 ranks, where the weights outweigh the activations: auto
    cuts Q, K, V and the MLP's first layer by columns, attention by heads, the output
    projection and the MLP's second layer by rows (their summed features), as Megatron does,
    and is predicted no slower than model parallelism, which cuts every layer by columns."""
    spec = gpt(length=64, width=512, heads=8, blocks=1, vocab=64).to_spec()
    path = tmp_path / "block.json"
    path.write_text(json.dumps(spec))
    reports = {}
    for strategy in ("auto", "model"):
        out = tmp_path / f"{strategy}.json"
        args = ["partition", str(path), "--batch", "1", "--ranks", "8", "--strategy", strategy]
        assert main([*args, "--json", str(out)]) == 0
        reports[strategy] = json.loads(out.read_text())
    grids = {row["layer"]: row["grid"] for row in reports["auto"]["layers"]}
    for column in ("b0_q", "b0_k", "b0_v", "b0_fc"):
        assert grids[column] == [1, 1, 8, 1], column
    for row in ("b0_proj", "b0_fc_out"):
        assert grids[row] == [1, 1, 1, 8], row
    assert grids["b0_qh"] == grids["b0_attn"] == [1, 8, 1, 1]
    auto, model = (reports[s]["predicted_step_seconds"] for s in ("auto", "model"))
    assert auto <= model
