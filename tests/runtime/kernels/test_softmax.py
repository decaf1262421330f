import numpy as np
import pytest

from runtime.kernels.softmax import accuracy, evaluate_forward, softmax_backward, softmax_forward
from tests.error_bounds import assert_close_to
from tests.numeric_grad import assert_grad, numeric_grad


def _inputs(n, classes, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    x = (2.0 * rng.standard_normal((n, classes, 1, 1))).astype(dtype)
    labels = rng.integers(0, classes, (n, 1, 1, 1)).astype(np.int32)
    return x, labels


def _reference(x, labels, batch_total):
    z = x[:, :, 0, 0].astype(np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(z)), labels.ravel()]).sum() / batch_total
    return p[:, :, None, None], loss


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("n", "classes", "total"), [(1, 2, 1), (5, 10, 8), (3, 1, 3)])
def test_matches_numpy(n, classes, total, dtype):
    x, labels = _inputs(n, classes, dtype)
    prob, loss = softmax_forward(x, labels, total)
    ref_p, ref_loss = _reference(x, labels, total)
    assert prob.dtype == loss.dtype == dtype and loss.shape == (1, 1, 1, 1)
    np.testing.assert_allclose(prob, ref_p, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-5, atol=1e-7)
    dx = softmax_backward(prob, labels, total)
    onehot = np.eye(classes)[labels.ravel()][:, :, None, None]
    np.testing.assert_allclose(dx, (ref_p - onehot) / total, rtol=1e-5, atol=1e-7)


def test_large_logits_are_stable():
    x = np.array([[1000.0, 0.0, -1000.0], [-1e4, -1e4, -1e4 + 1]], np.float32)[:, :, None, None]
    labels = np.array([2, 0], np.int32).reshape(2, 1, 1, 1)
    prob, loss = softmax_forward(x, labels, 2)
    assert np.all(np.isfinite(prob)) and np.isfinite(loss).all()
    np.testing.assert_allclose(prob.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        loss.item(), (2000.0 + 1.0 + np.log1p(2 * np.exp(-1))) / 2, rtol=1e-6
    )


def test_numerical_gradient():
    x, labels = _inputs(3, 4)
    prob, _ = softmax_forward(x, labels, 4)
    dx = softmax_backward(prob, labels, 4)
    num = numeric_grad(lambda: softmax_forward(x, labels, 4)[1], x, np.ones((1, 1, 1, 1)))
    assert_grad(dx, num)


def test_batch_pieces_add_up():
    x, labels = _inputs(7, 6, seed=3)
    prob, loss = softmax_forward(x, labels, 7)
    halves = (slice(0, 3), slice(3, 7))
    pieces = [softmax_forward(x[s], labels[s], 7) for s in halves]
    # the loss sums positive per-sample terms, the same in both: only the order of the sum differs
    assert_close_to(pieces[0][1] + pieces[1][1], loss, loss, 7 + 1)
    np.testing.assert_allclose(np.concatenate([p[0] for p in pieces]), prob, rtol=1e-12)
    stats = [evaluate_forward(prob[s], labels[s]) for s in halves]
    np.testing.assert_allclose(stats[0] + stats[1], evaluate_forward(prob, labels), rtol=1e-12)


def test_evaluate_matches_argsort():
    x, labels = _inputs(40, 12, seed=5)
    prob, loss = softmax_forward(x, labels, 40)
    stats = evaluate_forward(prob, labels)
    assert stats.shape == (4, 1, 1, 1) and stats.dtype == np.float64
    order = np.argsort(-prob[:, :, 0, 0], axis=1, kind="stable")
    y = labels.ravel()
    top1 = np.sum(order[:, 0] == y)
    top5 = np.sum(np.any(order[:, :5] == y[:, None], axis=1))
    assert 0 < top1 < top5 < 40
    np.testing.assert_allclose(stats.ravel(), [loss.item() * 40, top1, top5, 40], rtol=1e-10)
    assert accuracy(stats) == pytest.approx(top1 / 40)


def test_evaluate_few_classes_and_ties():
    prob = np.full((4, 3, 1, 1), 1.0 / 3.0, np.float32)
    labels = np.array([0, 1, 2, 0], np.int32).reshape(4, 1, 1, 1)
    stats = evaluate_forward(prob, labels).ravel()
    # Ties go to the first class; with 3 classes top-5 is top-3, always correct.
    np.testing.assert_allclose(stats, [4 * np.log(3.0), 2, 4, 4], rtol=1e-6)
    assert accuracy(stats) == 0.5


def test_evaluate_zero_probability_is_finite():
    prob = np.array([[1.0, 0.0]], np.float64)[:, :, None, None]
    stats = evaluate_forward(prob, np.ones((1, 1, 1, 1), np.int32))
    assert np.isfinite(stats).all() and stats[0, 0, 0, 0] > 700


def test_bad_arguments():
    x, labels = _inputs(3, 4)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        softmax_forward(x, labels + 4, 3)
    with pytest.raises(ValueError, match="labels must be an int32 array"):
        softmax_forward(x, labels.astype(np.int64), 3)
    with pytest.raises(ValueError, match=r"labels must have shape \(3, 1, 1, 1\)"):
        softmax_forward(x, labels[:2], 3)
    with pytest.raises(ValueError, match="batch_total must be an int >= the piece's batch 3"):
        softmax_backward(x, labels, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(n, classes, 1, 1\)"):
        softmax_forward(x.reshape(3, 2, 2, 1), labels, 3)
    with pytest.raises(ValueError, match="stats sample count must be positive"):
        accuracy(np.zeros((4, 1, 1, 1)))


def test_empty_batch_piece_contributes_nothing():
    x, labels = _inputs(0, 5)
    prob, loss = softmax_forward(x, labels, 4)
    assert prob.shape == (0, 5, 1, 1) and loss.item() == 0.0
    np.testing.assert_array_equal(evaluate_forward(prob, labels), np.zeros((4, 1, 1, 1)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_rows_in_blocks_equal_the_whole(monkeypatch, causal, block):
    """Blocks of rows (`ROWS_BLOCK_ELEMENTS`) that cut matrices anywhere give every row its own
    columns: causal row i of a matrix keeps columns ≤ first_row + i, the rest exactly 0."""
    from runtime.kernels import softmax as module

    monkeypatch.setattr(module, "ROWS_BLOCK_ELEMENTS", block)
    matrices, rows, columns, first_row = 3, 5, 9, 2
    x = np.random.default_rng(1).standard_normal((matrices * rows, columns)) * 4
    y = np.empty_like(x)
    tops, totals = module.softmax_rows(x, y, causal, rows, first_row)
    for r in range(matrices * rows):
        last = min(columns, first_row + r % rows + 1) if causal else columns
        z = x[r, :last]
        e = np.exp(z - z.max())
        np.testing.assert_allclose(y[r, :last], e / e.sum(), rtol=1e-14)
        assert not y[r, last:].any()
        assert tops[r] == z.max() and totals[r] == pytest.approx(e.sum(), rel=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_and_statistics_over_row_blocks_equal_one_block(monkeypatch, dtype):
    """A language model's piece has many rows: they are taken a block at a time, here 3 rows
    of 6 classes (with a last block of 1), with ties so that their order by index counts."""
    from runtime.kernels import softmax

    x, labels = _inputs(10, 6, dtype, seed=7)
    x[2, :, 0, 0] = x[2, 0, 0, 0]  # every class tied: only those at lower indices rank ahead
    prob, _ = softmax_forward(x, labels, 10)
    whole = softmax_backward(prob, labels, 10), evaluate_forward(prob, labels)
    monkeypatch.setattr(softmax, "ROWS_BLOCK_ELEMENTS", 18)
    blocked = softmax_backward(prob, labels, 10), evaluate_forward(prob, labels)
    np.testing.assert_array_equal(blocked[0], whole[0])  # row by row the same float64 sums
    np.testing.assert_array_equal(blocked[1][1:], whole[1][1:])  # counts
    assert_close_to(blocked[1][0], whole[1][0], whole[1][0], 10)  # a sum, in another order
    p, y = prob[:, :, 0, 0].astype(np.float64), labels.ravel()
    expected = np.array(p)
    expected[np.arange(10), y] -= 1.0
    np.testing.assert_array_equal(blocked[0][:, :, 0, 0], (expected * 0.1).astype(dtype))
    ahead = [
        sum(p[i, j] > p[i, y[i]] or (p[i, j] == p[i, y[i]] and j < y[i]) for j in range(6))
        for i in range(10)
    ]
    assert blocked[1][1, 0, 0, 0] == sum(a < 1 for a in ahead)
    assert blocked[1][2, 0, 0, 0] == sum(a < 5 for a in ahead) < 10
