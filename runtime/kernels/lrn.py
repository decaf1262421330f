"""The `lrn` op: local response normalization across channels, ONNX's LRN.

For x (N, C, H, W), with below = ⌊(size − 1)/2⌋ and above = ⌈(size − 1)/2⌉ (`window`):

    s[c] = bias + alpha/size · Σ x[i]²  over i in [c − below, c + above] ∩ [0, C)
    y[c] = x[c] / s[c]^beta
    dx[c] = dy[c]·s[c]^−beta − (2·alpha·beta/size)·x[c]·Σ dy[c′]·x[c′]·s[c′]^(−beta−1)
            over the c′ whose window holds c: c′ in [c − above, c + below] ∩ [0, C)

(every index at the same n, h, w). The denominators and the sums are computed in float64 and
only the result is rounded to the array's dtype, so float32 and float64 differ by that rounding.

`lrn_forward` and `lrn_backward` take whole tensors. A piece of a partitioned task holds only the
channels its windows reach (its *channel halo*), so the `*_piece` kernels take, for each array,
the tensor channel its first channel is, the channels [first, last) to compute and the tensor's
channel count C: a window clipped at 0 or C there is clipped exactly as in the whole tensor, and
a view that misses a channel a window needs is a ValueError rather than a silently short sum.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded


def window(size: int) -> tuple[int, int]:
    """(below, above): how many channels the window of `size` reaches down and up."""
    below = (size - 1) // 2
    return below, size - 1 - below


@njit(cache=True, nogil=True, inline="always")
def _row_denominators(x, i, r, x_first, first, channels, below, above, scale, bias, s):
    """s[j] = bias + scale·Σ x² along row r of sample i, over the window of tensor channel
    first + j; x holds the tensor's channels from x_first on."""
    k, w = s.shape
    for j in range(k):
        c = first + j
        for q in range(w):
            s[j, q] = 0.0
        for m in range(max(0, c - below) - x_first, min(channels, c + above + 1) - x_first):
            for q in range(w):
                v = np.float64(x[i, m, r, q])
                s[j, q] += v * v
        for q in range(w):
            s[j, q] = bias + scale * s[j, q]


@njit(cache=True, nogil=True, inline="always")
def _inverse_power(s, beta):
    """s^−beta; for ONNX's default 0.75 (every model of the zoo) as 1/(√s·√√s), a few ulps like
    the power but a sixth of its time, which dominated the kernels."""
    if beta == 0.75:
        root = math.sqrt(s)
        return 1.0 / (root * math.sqrt(root))
    return s**-beta


# A job is one row of one sample across the channels: its float64 scratch is a few rows, where
# denominators of the whole piece would double an activation's memory (AlexNet's first LRN).


@threaded
def _forward(x, x_first, first, channels, below, above, scale, bias, beta, y):
    """y of tensor channels [first, first + y.shape[1])."""
    n, k, h, w = y.shape
    for job in prange(n * h):
        i, r = job // h, job % h
        s = np.empty((k, w))
        _row_denominators(x, i, r, x_first, first, channels, below, above, scale, bias, s)
        for j in range(k):
            for q in range(w):
                y[i, j, r, q] = np.float64(x[i, first + j - x_first, r, q]) * _inverse_power(
                    s[j, q], beta
                )


@threaded
def _backward(dy, dy_first, x, x_first, lo, first, channels, below, above, scale, bias, beta, dx):
    """dx of tensor channels [first, first + dx.shape[1]), from the outputs [lo, lo + ...)
    whose windows reach them."""
    n, k, h, w = dx.shape
    reached = min(channels, first + k + below) - lo
    k2 = 2.0 * scale * beta
    for job in prange(n * h):
        i, r = job // h, job % h
        s = np.empty((reached, w))
        _row_denominators(x, i, r, x_first, lo, channels, below, above, scale, bias, s)
        # t[c′] = dy·x·s^(−beta−1), each output's share of the gradient of the squares it sums;
        # s becomes s^−beta
        t = np.empty((reached, w))
        for j in range(reached):
            c = lo + j
            for q in range(w):
                p = _inverse_power(s[j, q], beta)
                t[j, q] = (
                    np.float64(dy[i, c - dy_first, r, q])
                    * np.float64(x[i, c - x_first, r, q])
                    * (p / s[j, q])
                )
                s[j, q] = p
        total = np.empty(w)
        for j in range(k):
            c = first + j
            for q in range(w):
                total[q] = 0.0
            for m in range(max(0, c - above) - lo, min(channels, c + below + 1) - lo):
                for q in range(w):
                    total[q] += t[m, q]
            for q in range(w):
                dx[i, j, r, q] = (
                    np.float64(dy[i, c - dy_first, r, q]) * s[c - lo, q]
                    - k2 * np.float64(x[i, c - x_first, r, q]) * total[q]
                )


def _attributes(size: int, alpha: float, beta: float, bias: float) -> None:
    """ONNX's attributes, restricted to a denominator s ≥ bias > 0 (any real power of it)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    for name, value in (("alpha", alpha), ("beta", beta), ("bias", bias)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    if alpha < 0:
        raise ValueError(f"alpha must not be negative, got {alpha!r}")
    if bias <= 0:
        raise ValueError(f"bias must be positive, got {bias!r}")


def _holds(name: str, a: np.ndarray, a_first: int, lo: int, hi: int) -> None:
    """Require view `a`, whose first channel is tensor channel `a_first`, to hold [lo, hi)."""
    held = (a_first, a_first + a.shape[1])
    if lo < hi and (lo < held[0] or hi > held[1]):
        raise ValueError(
            f"{name} holds channels [{held[0]}, {held[1]}) but channels [{lo}, {hi}) are needed"
        )


def _channels(first: int, last: int, channels: int) -> None:
    if not 0 <= first <= last <= channels:
        raise ValueError(f"channels [{first}, {last}) must lie in [0, {channels})")


def _positions(name: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    """Require `a` to be `ref`'s dtype with its batch rows and positions (any channels)."""
    _checks.floating(name, a, 4)
    _checks.same_dtype(name, a, ref_name, ref)
    if a.shape[0] != ref.shape[0] or a.shape[2:] != ref.shape[2:]:
        raise ValueError(
            f"{name} {a.shape} must have the batch rows and positions of {ref_name} {ref.shape}"
        )


def lrn_forward_piece(
    x: np.ndarray,
    x_first: int,
    first: int,
    last: int,
    channels: int,
    size: int,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
) -> np.ndarray:
    """y of tensor channels [first, last) of a tensor of `channels` channels; `x` holds the
    input's channels from tensor channel `x_first` on, at least the windows' (clipped)."""
    _checks.floating("x", x, 4)
    _attributes(size, alpha, beta, bias)
    _channels(first, last, channels)
    below, above = window(size)
    if first < last:
        _holds("x", x, x_first, max(0, first - below), min(channels, last + above))
    x = np.ascontiguousarray(x)
    n, _, h, w = x.shape
    y = np.empty((n, last - first, h, w), x.dtype)
    scale, bias, beta = alpha / size, float(bias), float(beta)
    _forward(x, x_first, first, channels, below, above, scale, bias, beta, y)
    return y


def lrn_backward_piece(
    dy: np.ndarray,
    dy_first: int,
    x: np.ndarray,
    x_first: int,
    first: int,
    last: int,
    channels: int,
    size: int,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
) -> np.ndarray:
    """dx of tensor channels [first, last) of a tensor of `channels` channels; `dy` holds the
    output gradient's channels from `dy_first` on, at least [first − above, last + below)
    clipped, and `x` the input's from `x_first` on, at least [first − size + 1, last + size − 1)
    clipped (the windows of those outputs)."""
    _checks.floating("x", x, 4)
    _positions("dy", dy, "x", x)
    _attributes(size, alpha, beta, bias)
    _channels(first, last, channels)
    below, above = window(size)
    n, _, h, w = x.shape
    if first == last:
        return np.empty((n, 0, h, w), x.dtype)
    # the outputs whose windows reach [first, last), and the inputs their windows reach
    lo, hi = max(0, first - above), min(channels, last + below)
    _holds("dy", dy, dy_first, lo, hi)
    _holds("x", x, x_first, max(0, lo - below), min(channels, hi + above))
    x, dy = np.ascontiguousarray(x), np.ascontiguousarray(dy)
    dx = np.empty((n, last - first, h, w), x.dtype)
    scale, bias, beta = alpha / size, float(bias), float(beta)
    _backward(dy, dy_first, x, x_first, lo, first, channels, below, above, scale, bias, beta, dx)
    return dx


def lrn_forward(
    x: np.ndarray, size: int, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0
) -> np.ndarray:
    """y = x / (bias + alpha/size · Σ_window x²)^beta over the channels of x (N, C, H, W)."""
    _checks.floating("x", x, 4)
    channels = x.shape[1]
    return lrn_forward_piece(x, 0, 0, channels, channels, size, alpha, beta, bias)


def lrn_backward(
    dy: np.ndarray,
    x: np.ndarray,
    size: int,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
) -> np.ndarray:
    """dx from the output gradient dy and the forward's input x, both (N, C, H, W)."""
    _checks.floating("x", x, 4)
    _checks.like("dy", dy, "x", x)
    channels = x.shape[1]
    return lrn_backward_piece(dy, 0, x, 0, 0, channels, channels, size, alpha, beta, bias)
