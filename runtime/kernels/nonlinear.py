"""The `filterNL` op: an elementwise nonlinearity (relu, tanh or sigmoid).

The backward is computed from the forward *output* y, not the input: all three derivatives are
cheap functions of y (relu: [y > 0], tanh: 1 − y², sigmoid: y(1 − y)), so the task graph keeps
only the output alive between the passes. The function is passed to Numba as a small integer code
so one compiled loop serves all three.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks

FUNCTIONS = {"relu": 0, "tanh": 1, "sigmoid": 2}


@njit(cache=True, nogil=True)
def _sigmoid(v):
    # Split by sign so exp never overflows.
    if v >= 0:
        return 1.0 / (1.0 + np.exp(-v))
    e = np.exp(v)
    return e / (1.0 + e)


@njit(cache=True, nogil=True, parallel=True)
def _forward(x, code, y):
    n, c, h, w = x.shape
    zero = x.dtype.type(0)
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for s in range(w):
                v = x[i, j, r, s]
                if code == 0:
                    y[i, j, r, s] = max(zero, v)
                elif code == 1:
                    y[i, j, r, s] = np.tanh(v)
                else:
                    y[i, j, r, s] = _sigmoid(v)


@njit(cache=True, nogil=True, parallel=True)
def _backward(dy, y, code, dx):
    n, c, h, w = dy.shape
    zero = dy.dtype.type(0)
    one = dy.dtype.type(1)
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for s in range(w):
                g = dy[i, j, r, s]
                v = y[i, j, r, s]
                if code == 0:
                    dx[i, j, r, s] = g if v > zero else zero
                elif code == 1:
                    dx[i, j, r, s] = g * (one - v * v)
                else:
                    dx[i, j, r, s] = g * v * (one - v)


def filterNL_forward(x: np.ndarray, fn: str) -> np.ndarray:
    """y = fn(x) elementwise for an x of rank 1 to 4; fn is "relu", "tanh" or "sigmoid"."""
    code = _checks.code("fn", fn, FUNCTIONS)
    four = _checks.four_d("x", x)
    y = np.empty(four.shape, x.dtype)
    _forward(four, code, y)
    return y.reshape(x.shape)


def filterNL_backward(dy: np.ndarray, y: np.ndarray, fn: str) -> np.ndarray:
    """dx = dy·fn'(x), computed from the forward output y."""
    code = _checks.code("fn", fn, FUNCTIONS)
    four = _checks.four_d("dy", dy)
    _checks.like("y", y, "dy", dy)
    dx = np.empty(four.shape, dy.dtype)
    _backward(four, y.reshape(four.shape), code, dx)
    return dx.reshape(dy.shape)
