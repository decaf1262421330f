"""The `layernorm` op over the last axis of (N, T, D), statistics in float64.

With x̂ = (x − μ)/σ, σ = √(var + eps) (the biased variance, as PyTorch), y = x̂·γ + β and
g = dy·γ, the input gradient is dx = (g − mean(g) − x̂·mean(g·x̂)) / σ; the parameters' are
Σ dy·x̂ and Σ dy over the piece's tokens. Tokens are independent, so the rows run in parallel,
and the parameter sums are kept per row block and added in row order at the end.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded

#: tokens per block of the parameter gradients' partial sums
ROW_BLOCK = 64


@njit(cache=True, nogil=True, inline="always")
def _statistics(x, eps):
    d = x.shape[0]
    mean = 0.0
    for k in range(d):
        mean += np.float64(x[k])
    mean /= d
    var = 0.0
    for k in range(d):
        v = np.float64(x[k]) - mean
        var += v * v
    return mean, 1.0 / math.sqrt(var / d + eps)


@threaded
def _forward(x, gamma, beta, eps, y):
    rows, d = x.shape
    for i in prange(rows):
        mean, inv = _statistics(x[i], eps)
        for k in range(d):
            y[i, k] = (np.float64(x[i, k]) - mean) * inv * gamma[k] + beta[k]


@threaded
def _backward(dy, x, gamma, eps, need_dx, dx, dgamma_blocks, dbeta_blocks):
    rows, d = x.shape
    blocks = dgamma_blocks.shape[0]
    for b in prange(blocks):
        for i in range(b * ROW_BLOCK, min(rows, (b + 1) * ROW_BLOCK)):
            mean, inv = _statistics(x[i], eps)
            g_mean = 0.0
            gx_mean = 0.0
            for k in range(d):
                xhat = (np.float64(x[i, k]) - mean) * inv
                g = np.float64(dy[i, k]) * gamma[k]
                g_mean += g
                gx_mean += g * xhat
                dgamma_blocks[b, k] += np.float64(dy[i, k]) * xhat
                dbeta_blocks[b, k] += np.float64(dy[i, k])
            if need_dx:
                g_mean /= d
                gx_mean /= d
                for k in range(d):
                    xhat = (np.float64(x[i, k]) - mean) * inv
                    g = np.float64(dy[i, k]) * gamma[k]
                    dx[i, k] = (g - g_mean - xhat * gx_mean) * inv


def _tokens(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


def _check(x: np.ndarray, gamma: np.ndarray) -> None:
    _checks.floating("x", x, 3)
    _checks.floating("gamma", gamma, 1)
    _checks.shape("gamma", gamma, x.shape[2:])
    _checks.same_dtype("gamma", gamma, "x", x)


def layernorm_forward(
    x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """y (N, T, D): every token of x normalised over D, scaled by gamma and shifted by beta."""
    _check(x, gamma)
    _checks.like("beta", beta, "gamma", gamma)
    y = np.empty(x.shape, x.dtype)
    _forward(_tokens(x), gamma, beta, float(eps), _tokens(y))
    return y


def layernorm_backward(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, eps: float = 1e-5, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, dgamma, dbeta) of `layernorm_forward`, from its input x."""
    _check(x, gamma)
    _checks.like("dy", dy, "x", x)
    rows = x.shape[0] * x.shape[1]
    blocks = max(1, -(-rows // ROW_BLOCK))
    dgamma = np.zeros((blocks, x.shape[2]), np.float64)
    dbeta = np.zeros((blocks, x.shape[2]), np.float64)
    dx = np.empty(x.shape if need_dx else (0, 0, x.shape[2]), x.dtype)
    _backward(_tokens(dy), _tokens(x), gamma, float(eps), need_dx, _tokens(dx), dgamma, dbeta)
    return (
        dx if need_dx else None,
        dgamma.sum(axis=0).astype(x.dtype),
        dbeta.sum(axis=0).astype(x.dtype),
    )
