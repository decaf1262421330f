"""The `maxpool` and `avgpool` ops over (N, C, H, W) with any window, stride and (asymmetric)
padding.

Padding is given per side, (top, bottom, left, right), because a spatial piece of a tensor only
pads on the sides that touch the tensor's border; its other sides carry a halo of real rows
instead. Padded cells never win: each window takes the maximum over its real cells only, and every
pad must be smaller than the window so that no window is all padding.

The backward routes each output gradient to its window's argmax, the first maximum in row-major
window order (as argmax would pick), and accumulates where overlapping windows pick the same cell.
`avgpool` averages each window over its real cells only (ONNX's `count_include_pad` 0), and its
backward shares each output gradient equally among them. Each (n, c) plane is independent,
which is what the parallel loop splits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.threaded import inner, threaded


@inner
def _argmax(x, i, j, r0, s0, kh, kw):
    h, w = x.shape[2], x.shape[3]
    r_lo, r_hi = max(r0, 0), min(r0 + kh, h)
    s_lo, s_hi = max(s0, 0), min(s0 + kw, w)
    best_r, best_s = r_lo, s_lo
    best = x[i, j, r_lo, s_lo]
    for r in range(r_lo, r_hi):
        for s in range(s_lo, s_hi):
            if x[i, j, r, s] > best:
                best, best_r, best_s = x[i, j, r, s], r, s
    return best_r, best_s


@threaded
def _forward(x, kh, kw, sh, sw, top, left, y):
    n, c = x.shape[0], x.shape[1]
    ho, wo = y.shape[2], y.shape[3]
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for p in range(ho):
            for q in range(wo):
                r, s = _argmax(x, i, j, p * sh - top, q * sw - left, kh, kw)
                y[i, j, p, q] = x[i, j, r, s]


@threaded
def _backward(dy, x, kh, kw, sh, sw, top, left, dx):
    n, c = x.shape[0], x.shape[1]
    ho, wo = dy.shape[2], dy.shape[3]
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for p in range(ho):
            for q in range(wo):
                r, s = _argmax(x, i, j, p * sh - top, q * sw - left, kh, kw)
                dx[i, j, r, s] += dy[i, j, p, q]


@threaded
def _average(x, kh, kw, sh, sw, top, left, y):
    n, c, h, w = x.shape
    ho, wo = y.shape[2], y.shape[3]
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for p in range(ho):
            r_lo, r_hi = max(p * sh - top, 0), min(p * sh - top + kh, h)
            for q in range(wo):
                s_lo, s_hi = max(q * sw - left, 0), min(q * sw - left + kw, w)
                total = 0.0
                for r in range(r_lo, r_hi):
                    for s in range(s_lo, s_hi):
                        total += x[i, j, r, s]
                y[i, j, p, q] = total / ((r_hi - r_lo) * (s_hi - s_lo))


@threaded
def _average_backward(dy, kh, kw, sh, sw, top, left, dx):
    n, c, h, w = dx.shape
    ho, wo = dy.shape[2], dy.shape[3]
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        for p in range(ho):
            r_lo, r_hi = max(p * sh - top, 0), min(p * sh - top + kh, h)
            for q in range(wo):
                s_lo, s_hi = max(q * sw - left, 0), min(q * sw - left + kw, w)
                share = dy[i, j, p, q] / ((r_hi - r_lo) * (s_hi - s_lo))
                for r in range(r_lo, r_hi):
                    for s in range(s_lo, s_hi):
                        dx[i, j, r, s] += share


def _pads(pad: int | Sequence[int]) -> tuple[int, int, int, int]:
    vals = (pad,) * 4 if np.isscalar(pad) else tuple(pad)
    if len(vals) != 4 or any(int(v) != v or v < 0 for v in vals):
        raise ValueError(f"pad must be an int or (top, bottom, left, right) >= 0, got {pad!r}")
    return tuple(int(v) for v in vals)


def _geometry(
    x: np.ndarray,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int],
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int, int], tuple[int, int]]:
    """Validated (kernel, stride, pads, output size) for an input x."""
    _checks.floating("x", x, 4)
    return _window_geometry(x.shape, kernel, stride, pad)


def _window_geometry(
    shape: Sequence[int],
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int],
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int, int, int], tuple[int, int]]:
    """`_geometry` for an input of `shape` (N, C, H, W)."""
    kh, kw = _checks.pair("kernel", kernel)
    sh, sw = _checks.pair("stride", stride)
    top, bottom, left, right = _pads(pad)
    if min(kh, kw, sh, sw) < 1:
        raise ValueError(f"kernel {(kh, kw)} and stride {(sh, sw)} must be positive")
    if max(top, bottom) >= kh or max(left, right) >= kw:
        raise ValueError(f"pad {(top, bottom, left, right)} must be smaller than kernel {(kh, kw)}")
    h, w = shape[2] + top + bottom, shape[3] + left + right
    if h < kh or w < kw:
        raise ValueError(f"kernel {(kh, kw)} exceeds padded input {(h, w)} of x {tuple(shape)}")
    out = ((h - kh) // sh + 1, (w - kw) // sw + 1)
    return (kh, kw), (sh, sw), (top, bottom, left, right), out


def _pooled(window_kernel, x: np.ndarray, kernel, stride, pad) -> np.ndarray:
    """The output of a forward `window_kernel` (`_forward`, `_average`) over x."""
    (kh, kw), (sh, sw), (top, _, left, _), (ho, wo) = _geometry(x, kernel, stride, pad)
    y = np.empty((x.shape[0], x.shape[1], ho, wo), x.dtype)
    window_kernel(x, kh, kw, sh, sw, top, left, y)
    return y


def maxpool_forward(
    x: np.ndarray,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int] = 0,
) -> np.ndarray:
    """y (N, C, Ho, Wo): the maximum of each window over the real (unpadded) cells of x."""
    return _pooled(_forward, x, kernel, stride, pad)


def maxpool_backward(
    dy: np.ndarray,
    x: np.ndarray,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int] = 0,
) -> np.ndarray:
    """dx (N, C, H, W): each dy added to its window's first argmax in x."""
    (kh, kw), (sh, sw), (top, _, left, _), (ho, wo) = _geometry(x, kernel, stride, pad)
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, (x.shape[0], x.shape[1], ho, wo))
    _checks.same_dtype("dy", dy, "x", x)
    dx = np.zeros(x.shape, x.dtype)
    _backward(dy, x, kh, kw, sh, sw, top, left, dx)
    return dx


def avgpool_forward(
    x: np.ndarray,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int] = 0,
) -> np.ndarray:
    """y (N, C, Ho, Wo): the mean of each window over the real (unpadded) cells of x."""
    return _pooled(_average, x, kernel, stride, pad)


def avgpool_backward(
    dy: np.ndarray,
    input_shape: Sequence[int],
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int] = 0,
) -> np.ndarray:
    """dx (N, C, H, W) of an input of `input_shape`: each dy shared equally among its window's
    real cells."""
    shape = tuple(int(v) for v in input_shape)
    (kh, kw), (sh, sw), (top, _, left, _), (ho, wo) = _window_geometry(shape, kernel, stride, pad)
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, (shape[0], shape[1], ho, wo))
    dx = np.zeros(shape, dy.dtype)
    _average_backward(dy, kh, kw, sh, sw, top, left, dx)
    return dx
