"""The `gelu` op: the Gaussian error linear unit, exact or in its tanh approximation.

Exact (PyTorch's `approximate="none"`, ONNX's Gelu): y = x·Φ(x) = ½x(1 + erf(x/√2)), whose
derivative is Φ(x) + x·φ(x). Tanh (`approximate="tanh"`, GPT-2's): y = ½x(1 + tanh u) with
u = √(2/π)(x + 0.044715x³), whose derivative is ½(1 + tanh u) + ½x(1 − tanh²u)·√(2/π)(1 +
3·0.044715x²). Neither derivative is a function of y alone, so the backward reads the forward's
input (filterNL's read its output). Each element is computed in float64 and stored in the
array's dtype, so float32 and float64 runs differ only by that rounding.

The exact form reads Φ and its slope from tables rather than calling libm's erf and exp, which
took 7 ns an element (a GPT step spent a quarter of its time there): on [−14, 10], cut into
pieces of 1/8, each function is its Chebyshev interpolant of degree 8, built when the module is
imported from `math.erfc` and evaluated by Clenshaw's recurrence. The interpolation error is
below 1e-17 (the 9th derivative of Φ is under 40); what remains is the recurrence's rounding,
a few ulps. Beyond the range, Φ and the slope are 0 (below −14, where x·Φ(x) < 1e-43) or 1.
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


#: the tables' range, pieces per unit and degree
TABLE_LO, TABLE_HI, PIECES_PER_UNIT, DEGREE = -14.0, 10.0, 8, 8


def _tables() -> np.ndarray:
    """(2, pieces, DEGREE + 1): the Chebyshev coefficients of Φ and of its slope Φ + x·φ on
    each piece, from their values at the piece's Chebyshev points."""
    n = DEGREE + 1
    theta = np.pi * (np.arange(n) + 0.5) / n
    pieces = round((TABLE_HI - TABLE_LO) * PIECES_PER_UNIT)
    x = TABLE_LO + (np.arange(pieces)[:, None] + 0.5 + np.cos(theta)[None, :] / 2) / PIECES_PER_UNIT
    phi = 0.5 * np.vectorize(math.erfc)(-x * _SQRT_HALF)
    slope = phi + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)
    basis = np.cos(np.outer(np.arange(n), theta)) * (2.0 / n)
    basis[0] /= 2
    return np.ascontiguousarray(np.stack([phi @ basis.T, slope @ basis.T]))


TABLES = _tables()


#: elements per parallel chunk of the flat loops
CHUNK = 4096


@njit(cache=True, nogil=True, inline="always")
def _interpolated(tables, which, v):
    """Φ (`which` 0) or its slope (1) at v, from `TABLES`: branch-free but for the final
    choice, so that the loop over elements vectorises (the coefficients are gathered)."""
    u = (min(max(v, TABLE_LO), TABLE_HI - 1e-9) - TABLE_LO) * PIECES_PER_UNIT
    piece = int(u)
    z = 2.0 * (u - piece) - 1.0
    b1 = 0.0
    b2 = 0.0
    for k in range(DEGREE, 0, -1):
        b0 = tables[which, piece, k] + 2.0 * z * b1 - b2
        b2 = b1
        b1 = b0
    inside = tables[which, piece, 0] + z * b1 - b2
    return 1.0 if v >= TABLE_HI else (inside if v > TABLE_LO else (0.0 if v <= TABLE_LO else v))


@njit(cache=True, nogil=True, inline="always")
def _tanh_value(v):
    return 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v)))


@njit(cache=True, nogil=True, inline="always")
def _tanh_slope(v):
    t = math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (
        1.0 + 3.0 * _CUBIC * v * v
    )


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _forward(x, code, tables, y):
    n = x.size
    for chunk in prange((n + CHUNK - 1) // CHUNK):
        end = min(n, (chunk + 1) * CHUNK)
        if code == 0:
            for i in range(chunk * CHUNK, end):
                v = np.float64(x[i])
                y[i] = v * _interpolated(tables, 0, v)
        else:
            for i in range(chunk * CHUNK, end):
                y[i] = _tanh_value(np.float64(x[i]))


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _backward(dy, x, code, tables, dx):
    n = x.size
    for chunk in prange((n + CHUNK - 1) // CHUNK):
        end = min(n, (chunk + 1) * CHUNK)
        if code == 0:
            for i in range(chunk * CHUNK, end):
                dx[i] = np.float64(dy[i]) * _interpolated(tables, 1, np.float64(x[i]))
        else:
            for i in range(chunk * CHUNK, end):
                dx[i] = np.float64(dy[i]) * _tanh_slope(np.float64(x[i]))


def _flat(name: str, a: np.ndarray) -> np.ndarray:
    """A float array of any rank as a contiguous 1-d view (a copy where it is strided)."""
    _checks.floating(name, a)
    return np.ascontiguousarray(a).reshape(-1)


def gelu_forward(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """y = gelu(x) elementwise."""
    code = _checks.code("approximate", approximate, APPROXIMATIONS)
    flat = _flat("x", x)
    y = np.empty(flat.shape, x.dtype)
    _forward(flat, code, TABLES, y)
    return y.reshape(x.shape)


def gelu_backward(dy: np.ndarray, x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """dx = dy·gelu'(x), from the forward's input x."""
    code = _checks.code("approximate", approximate, APPROXIMATIONS)
    flat = _flat("dy", dy)
    _checks.like("x", x, "dy", dy)
    dx = np.empty(flat.shape, dy.dtype)
    _backward(flat, _flat("x", x), code, TABLES, dx)
    return dx.reshape(dy.shape)
