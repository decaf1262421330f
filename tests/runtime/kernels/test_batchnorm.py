import numpy as np
import pytest

from runtime.kernels.batchnorm import (
    batchnorm_forward,
    batchnorm_inference,
    batchnorm_input_backward,
    batchnorm_param_backward,
    batchnorm_running,
    batchnorm_stats,
)
from tests.error_bounds import assert_close_to
from tests.numeric_grad import assert_grad, numeric_grad

EPS = 1e-5


def _inputs(shape, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (3.0 + 2.0 * rng.standard_normal(shape)).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(dtype)
    beta = rng.standard_normal((1, c, 1, 1)).astype(dtype)
    return x, gamma, beta


def _count(x):
    return x.shape[0] * x.shape[2] * x.shape[3]


def _reference(x, gamma, beta):
    x = x.astype(np.float64)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    return gamma * (x - mean) / np.sqrt(var + EPS) + beta, mean, var


def _full(x, gamma, beta):
    return batchnorm_forward(x, batchnorm_stats(x), _count(x), gamma, beta)


def _backward(dy, x, gamma):
    stats, count = batchnorm_stats(x), _count(x)
    dgamma, dbeta = batchnorm_param_backward(dy, x, stats, count)
    dx = batchnorm_input_backward(dy, x, stats, count, gamma, dgamma, dbeta)
    return dx, dgamma, dbeta


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (1, 2, 3, 4), (7, 5, 1, 1)])
def test_matches_numpy(shape, dtype):
    x, gamma, beta = _inputs(shape, dtype)
    stats = batchnorm_stats(x)
    assert stats.shape == (2, shape[1], 1, 1) and stats.dtype == np.float64
    x64 = x.astype(np.float64)
    per_channel = x64.size // shape[1]
    sums = [x64.sum(axis=(0, 2, 3)), (x64**2).sum(axis=(0, 2, 3))]
    sizes = [np.abs(x64).sum(axis=(0, 2, 3)), sums[1]]
    for got, expected, size in zip(stats, sums, sizes):
        assert_close_to(got.ravel(), expected, size, per_channel + 1)
    y = batchnorm_forward(x, stats, _count(x), gamma, beta)
    ref, _, _ = _reference(x, gamma, beta)
    assert y.dtype == dtype
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    np.testing.assert_allclose(y, ref, **tol)

    dy = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    dx, dgamma, dbeta = _backward(dy, x, gamma)
    assert dx.dtype == dgamma.dtype == dbeta.dtype == dtype
    xhat = (ref - beta) / gamma
    dy64 = dy.astype(np.float64)
    np.testing.assert_allclose(dbeta, dy64.sum(axis=(0, 2, 3), keepdims=True), **tol)
    np.testing.assert_allclose(dgamma, (dy64 * xhat).sum(axis=(0, 2, 3), keepdims=True), **tol)


@pytest.mark.parametrize("shape", [(3, 2, 3, 2), (5, 3, 1, 1)])
def test_numerical_gradients_of_the_composition(shape):
    x, gamma, beta = _inputs(shape, seed=2)
    r = np.random.default_rng(3).standard_normal(shape)
    dx, dgamma, dbeta = _backward(r, x, gamma)

    def f():
        return _full(x, gamma, beta)

    assert_grad(dx, numeric_grad(f, x, r))
    assert_grad(dgamma, numeric_grad(f, gamma, r))
    assert_grad(dbeta, numeric_grad(f, beta, r))


@pytest.mark.parametrize("axis", [0, 2])
def test_pieces_match_the_whole(axis):
    x, gamma, beta = _inputs((5, 3, 6, 4), seed=4)
    dy = np.random.default_rng(5).standard_normal(x.shape)
    cut = [slice(None)] * 4
    pieces = []
    for s in (slice(0, 2), slice(2, None)):
        cut[axis] = s
        pieces.append(tuple(cut))
    stats, count = batchnorm_stats(x), _count(x)
    per_channel = x.size // x.shape[1]
    size = batchnorm_stats(np.abs(x))  # Σ|x| and Σx²: what bounds the sums' rounding
    assert_close_to(sum(batchnorm_stats(x[p]) for p in pieces), stats, size, per_channel + 1)

    y = np.concatenate(
        [batchnorm_forward(x[p], stats, count, gamma, beta) for p in pieces], axis=axis
    )
    np.testing.assert_allclose(y, _full(x, gamma, beta), rtol=1e-12)

    dx, dgamma, dbeta = _backward(dy, x, gamma)
    parts = [batchnorm_param_backward(dy[p], x[p], stats, count) for p in pieces]
    xhat = (x - stats[0] / count) / np.sqrt(stats[1] / count - (stats[0] / count) ** 2 + EPS)
    # dgamma = Σ dy·x̂, dbeta = Σ dy; x̂ is the same on both sides but for a few roundings
    dgamma_size = (np.abs(dy) * np.abs(xhat)).sum(axis=(0, 2, 3), keepdims=True)
    assert_close_to(parts[0][0] + parts[1][0], dgamma, dgamma_size, per_channel + 8)
    assert_close_to(parts[0][1] + parts[1][1], dbeta, np.abs(dy).sum(axis=(0, 2, 3), keepdims=True),
                    per_channel)  # fmt: skip
    dx_pieces = [
        batchnorm_input_backward(dy[p], x[p], stats, count, gamma, dgamma, dbeta) for p in pieces
    ]
    np.testing.assert_allclose(np.concatenate(dx_pieces, axis=axis), dx, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_running_and_inference(dtype):
    x, gamma, beta = _inputs((6, 3, 2, 5), dtype, seed=6)
    _, mean, var = _reference(x, gamma, beta)
    old = np.stack([np.full((3, 1, 1), 0.5), np.full((3, 1, 1), 2.0)]).astype(dtype)
    new = batchnorm_running(old, batchnorm_stats(x), _count(x), 0.9)
    assert new.shape == (2, 3, 1, 1) and new.dtype == dtype
    np.testing.assert_allclose(new[0], 0.9 * 0.5 + 0.1 * mean[0], rtol=1e-6)
    np.testing.assert_allclose(new[1], 0.9 * 2.0 + 0.1 * var[0], rtol=1e-6)

    y = batchnorm_inference(x, new, gamma, beta, EPS)
    ref = gamma * (x.astype(np.float64) - new[0:1]) / np.sqrt(new[1:2] + EPS) + beta
    assert y.dtype == dtype
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    # With the batch's own statistics as the running ones, inference is the training forward.
    exact = np.concatenate([mean, var]).astype(np.float64)
    np.testing.assert_allclose(
        batchnorm_inference(x, exact, gamma, beta), _full(x, gamma, beta), rtol=1e-4, atol=1e-4
    )


def test_bad_arguments():
    x, gamma, beta = _inputs((2, 3, 2, 2))
    stats = batchnorm_stats(x)
    with pytest.raises(ValueError, match=r"stats must have shape \(2, 3, 1, 1\)"):
        batchnorm_forward(x, stats[:, :2], 8, gamma, beta)
    with pytest.raises(ValueError, match=r"gamma must have shape \(1, 3, 1, 1\)"):
        batchnorm_forward(x, stats, 8, gamma.reshape(3, 1, 1, 1), beta)
    with pytest.raises(ValueError, match="count must be positive"):
        batchnorm_forward(x, stats, 0, gamma, beta)
    with pytest.raises(ValueError, match=r"dy must have shape \(2, 3, 2, 2\)"):
        batchnorm_param_backward(x[:1], x, stats, 8)
    with pytest.raises(ValueError, match=r"running must have shape \(2, C, 1, 1\)"):
        batchnorm_running(stats[0], stats, 8, 0.9)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\]"):
        batchnorm_running(stats, stats, 8, 1.5)
