"""Plain NumPy references for the filter and conv kernels: the oracle of the tests.

Written for obviousness, not speed: pad the input, then for every output position take the
explicit R×S window and contract it with that position's weights (untied) or the single
weight set (tied). The benchmark also times them as the "numpy" implementation.
"""

from __future__ import annotations

import numpy as np

from runtime.kernels.geometry import normalize_pad


def _padded(x: np.ndarray, pad) -> np.ndarray:
    top, bottom, left, right = normalize_pad(pad)
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))


def _output_size(x: np.ndarray, w: np.ndarray, stride: int, pad) -> tuple[int, int]:
    top, bottom, left, right = normalize_pad(pad)
    r, s = w.shape[4:6]
    return (
        (x.shape[2] + top + bottom - r) // stride + 1,
        (x.shape[3] + left + right - s) // stride + 1,
    )


def _weights_at(w: np.ndarray, p: int, q: int) -> np.ndarray:
    """(K, C, R, S) weights of output position (p, q)."""
    untied = w.shape[6:] != (1, 1)
    return w[:, 0, 0, :, :, :, p if untied else 0, q if untied else 0]


def filter_forward(x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0) -> np.ndarray:
    xp = _padded(x, pad)
    r, s = w.shape[4:6]
    p_out, q_out = _output_size(x, w, stride, pad)
    y = np.zeros((x.shape[0], w.shape[0], p_out, q_out), x.dtype)
    for p in range(p_out):
        for q in range(q_out):
            window = xp[:, :, p * stride : p * stride + r, q * stride : q * stride + s]
            y[:, :, p, q] = np.tensordot(window, _weights_at(w, p, q), axes=([1, 2, 3], [1, 2, 3]))
    return y


def filter_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    stride: int = 1,
    pad=0,
    channels: tuple[int, int] | None = None,
    need_dx: bool = True,
) -> tuple[np.ndarray | None, np.ndarray]:
    top, bottom, left, right = normalize_pad(pad)
    lo, hi = channels if channels is not None else (0, x.shape[1])
    xp = _padded(x, pad)
    dxp = np.zeros_like(xp) if need_dx else None
    dw = np.zeros_like(w[:, :, :, lo:hi])
    untied = w.shape[6:] != (1, 1)
    r, s = w.shape[4:6]
    for p in range(dy.shape[2]):
        for q in range(dy.shape[3]):
            rows = slice(p * stride, p * stride + r)
            cols = slice(q * stride, q * stride + s)
            g = dy[:, :, p, q]  # (N, K)
            if need_dx:
                dxp[:, :, rows, cols] += np.tensordot(g, _weights_at(w, p, q), axes=(1, 0))
            dw_pq = np.tensordot(g, xp[:, lo:hi, rows, cols], axes=(0, 0))  # (K, C, R, S)
            dw[:, 0, 0, :, :, :, p if untied else 0, q if untied else 0] += dw_pq
    dx = None
    if need_dx:
        dx = dxp[:, :, top : xp.shape[2] - bottom, left : xp.shape[3] - right]
    return dx, dw


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1, pad=0) -> np.ndarray:
    return filter_forward(x, w, stride, pad) + b


def conv_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    dx, dw = filter_backward(dy, x, w, stride, pad, need_dx=need_dx)
    return dx, dw, dy.sum(axis=(0, 2, 3)).reshape(1, -1, 1, 1)
