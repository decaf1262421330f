"""The `batchnorm` op: spatial batch normalisation per channel over (N, H, W).

Vanilla batchnorm of a (N, D) activation is the same op on (N, D, 1, 1). The op is split into
kernels around its two reductions so that a batch or spatial partition needs only two small
all-reduces per pass, never the activations of other pieces:

    forward:  stats = Σ_pieces batchnorm_stats(x_piece)    (2, C, 1, 1): [Σx, Σx²]
              y_piece = batchnorm_forward(x_piece, stats, count, gamma, beta)
    backward: (dgamma, dbeta) = Σ_pieces batchnorm_param_backward(dy_piece, x_piece, stats, count)
              dx_piece = batchnorm_input_backward(dy_piece, x_piece, stats, count, gamma,
                                                  dgamma, dbeta)

`count` is the number of elements per channel over the whole batch (N·H·W of the global tensor).
The statistics are float64 sums so that var = Σx²/count − mean² keeps its digits in float32
training; the variance is the biased (population) one, in training and in the running average.
Per-channel coefficients are prepared in NumPy (C values) and the Numba loops apply them.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded


@threaded
def _stats(x, out):
    n, c, h, w = x.shape
    for j in prange(c):
        s = 0.0
        s2 = 0.0
        for i in range(n):
            for r in range(h):
                for q in range(w):
                    v = np.float64(x[i, j, r, q])
                    s += v
                    s2 += v * v
        out[0, j] = s
        out[1, j] = s2


@threaded
def _channel_affine(x, scale, shift, y):
    n, c, h, w = x.shape
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for q in range(w):
                y[i, j, r, q] = x[i, j, r, q] * scale[j] + shift[j]


@threaded
def _param_backward(dy, x, mean, invstd, out):
    n, c, h, w = x.shape
    for j in prange(c):
        sg = 0.0
        sb = 0.0
        for i in range(n):
            for r in range(h):
                for q in range(w):
                    g = np.float64(dy[i, j, r, q])
                    sg += g * (x[i, j, r, q] - mean[j])
                    sb += g
        out[0, j] = sg * invstd[j]
        out[1, j] = sb


@threaded
def _input_backward(dy, x, mean, invstd, coef, count, dgamma, dbeta, dx):
    n, c, h, w = x.shape
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for q in range(w):
                xhat = (x[i, j, r, q] - mean[j]) * invstd[j]
                dx[i, j, r, q] = coef[j] * (count * dy[i, j, r, q] - dbeta[j] - xhat * dgamma[j])


def _channel(name: str, a: np.ndarray, c: int) -> np.ndarray:
    """A (1, C, 1, 1) per-channel parameter as a float64 vector."""
    _checks.floating(name, a)
    _checks.shape(name, a, (1, c, 1, 1))
    return a.reshape(c).astype(np.float64)


def _moments(
    x: np.ndarray, stats: np.ndarray, count: float, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, invstd) per channel from the global sums."""
    _checks.floating("x", x, 4)
    _checks.floating("stats", stats)
    _checks.shape("stats", stats, (2, x.shape[1], 1, 1))
    if not count > 0:
        raise ValueError(f"count must be positive, got {count}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    sums = stats.reshape(2, -1).astype(np.float64)
    mean = sums[0] / count
    var = np.maximum(sums[1] / count - mean * mean, 0.0)
    return mean, 1.0 / np.sqrt(var + eps)


def _grad(name: str, dy: np.ndarray, x: np.ndarray) -> None:
    _checks.floating(name, dy)
    _checks.shape(name, dy, x.shape)
    _checks.same_dtype(name, dy, "x", x)


def batchnorm_stats(x: np.ndarray) -> np.ndarray:
    """(2, C, 1, 1) float64 [Σx, Σx²] over N, H, W of this piece."""
    _checks.floating("x", x, 4)
    out = np.zeros((2, x.shape[1]), np.float64)
    _stats(x, out)
    return out.reshape(2, x.shape[1], 1, 1)


def batchnorm_forward(
    x: np.ndarray,
    stats: np.ndarray,
    count: float,
    gamma: np.ndarray,
    beta: np.ndarray,
    eps: float = 1e-5,
) -> np.ndarray:
    """y = gamma·(x − mean)/sqrt(var + eps) + beta with mean and var from the summed stats."""
    mean, invstd = _moments(x, stats, count, eps)
    c = x.shape[1]
    scale = _channel("gamma", gamma, c) * invstd
    shift = _channel("beta", beta, c) - mean * scale
    y = np.empty(x.shape, x.dtype)
    _channel_affine(x, scale, shift, y)
    return y


def batchnorm_param_backward(
    dy: np.ndarray, x: np.ndarray, stats: np.ndarray, count: float, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    """(dgamma, dbeta), each (1, C, 1, 1): Σ dy·x̂ and Σ dy over this piece."""
    mean, invstd = _moments(x, stats, count, eps)
    _grad("dy", dy, x)
    out = np.empty((2, x.shape[1]), np.float64)
    _param_backward(dy, x, mean, invstd, out)
    out = out.astype(x.dtype).reshape(2, 1, x.shape[1], 1, 1)
    return out[0], out[1]


def batchnorm_input_backward(
    dy: np.ndarray,
    x: np.ndarray,
    stats: np.ndarray,
    count: float,
    gamma: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
    eps: float = 1e-5,
) -> np.ndarray:
    """dx = gamma·invstd/count·(count·dy − dbeta − x̂·dgamma), with the batch totals of
    dgamma and dbeta."""
    mean, invstd = _moments(x, stats, count, eps)
    _grad("dy", dy, x)
    c = x.shape[1]
    coef = _channel("gamma", gamma, c) * invstd / count
    dg, db = _channel("dgamma", dgamma, c), _channel("dbeta", dbeta, c)
    dx = np.empty(x.shape, x.dtype)
    _input_backward(dy, x, mean, invstd, coef, float(count), dg, db, dx)
    return dx


def batchnorm_running(
    running: np.ndarray, stats: np.ndarray, count: float, momentum: float
) -> np.ndarray:
    """New [running_mean, running_var] (2, C, 1, 1) = momentum·old + (1 − momentum)·batch."""
    _checks.floating("running", running)
    if running.ndim != 4 or running.shape[0] != 2 or running.shape[2:] != (1, 1):
        raise ValueError(f"running must have shape (2, C, 1, 1), got {running.shape}")
    _checks.floating("stats", stats)
    _checks.shape("stats", stats, running.shape)
    if not count > 0:
        raise ValueError(f"count must be positive, got {count}")
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    sums = stats.astype(np.float64)
    mean = sums[0] / count
    var = np.maximum(sums[1] / count - mean * mean, 0.0)
    batch = np.stack([mean, var])
    return (momentum * running + (1.0 - momentum) * batch).astype(running.dtype)


def batchnorm_inference(
    x: np.ndarray,
    running: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    eps: float = 1e-5,
) -> np.ndarray:
    """y = gamma·(x − running_mean)/sqrt(running_var + eps) + beta."""
    _checks.floating("x", x, 4)
    c = x.shape[1]
    _checks.floating("running", running)
    _checks.shape("running", running, (2, c, 1, 1))
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    stat = running.reshape(2, c).astype(np.float64)
    scale = _channel("gamma", gamma, c) / np.sqrt(np.maximum(stat[1], 0.0) + eps)
    shift = _channel("beta", beta, c) - stat[0] * scale
    y = np.empty(x.shape, x.dtype)
    _channel_affine(x, scale, shift, y)
    return y
