"""The `gelu` op: the Gaussian error linear unit, exact or in its tanh approximation.

Exact (PyTorch's `approximate="none"`, ONNX's Gelu): y = x·Φ(x) = ½x(1 + erf(x/√2)), whose
derivative is Φ(x) + x·φ(x). Tanh (`approximate="tanh"`, GPT-2's): y = ½x(1 + tanh u) with
u = √(2/π)(x + 0.044715x³), whose derivative is ½(1 + tanh u) + ½x(1 − tanh²u)·√(2/π)(1 +
3·0.044715x²). Neither derivative is a function of y alone, so the backward reads the forward's
input (filterNL's read its output). Each element is computed in float64 and stored in the
array's dtype, so float32 and float64 runs differ only by that rounding.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks

#: PyTorch's names for the two forms
APPROXIMATIONS = {"none": 0, "tanh": 1}

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_CUBIC = 0.044715


@njit(cache=True, nogil=True, inline="always")
def _value(v, code):
    if code == 0:
        return 0.5 * v * (1.0 + math.erf(v * _SQRT_HALF))
    return 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v)))


@njit(cache=True, nogil=True, inline="always")
def _slope(v, code):
    if code == 0:
        return 0.5 * (1.0 + math.erf(v * _SQRT_HALF)) + v * _INV_SQRT_2PI * math.exp(-0.5 * v * v)
    t = math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (
        1.0 + 3.0 * _CUBIC * v * v
    )


@njit(cache=True, nogil=True, parallel=True)
def _forward(x, code, y):
    n, c, h, w = x.shape
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for s in range(w):
                y[i, j, r, s] = _value(np.float64(x[i, j, r, s]), code)


@njit(cache=True, nogil=True, parallel=True)
def _backward(dy, x, code, dx):
    n, c, h, w = dy.shape
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for r in range(h):
            for s in range(w):
                slope = _slope(np.float64(x[i, j, r, s]), code)
                dx[i, j, r, s] = np.float64(dy[i, j, r, s]) * slope


def gelu_forward(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """y = gelu(x) elementwise for an x of rank 1 to 4."""
    code = _checks.code("approximate", approximate, APPROXIMATIONS)
    four = _checks.four_d("x", x)
    y = np.empty(four.shape, x.dtype)
    _forward(four, code, y)
    return y.reshape(x.shape)


def gelu_backward(dy: np.ndarray, x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """dx = dy·gelu'(x), from the forward's input x."""
    code = _checks.code("approximate", approximate, APPROXIMATIONS)
    four = _checks.four_d("dy", dy)
    _checks.like("x", x, "dy", dy)
    dx = np.empty(four.shape, dy.dtype)
    _backward(four, x.reshape(four.shape), code, dx)
    return dx.reshape(dy.shape)
