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


def filter_backward_data(
    dy: np.ndarray, x_shape: tuple[int, ...], w: np.ndarray, stride: int = 1, pad=0
) -> np.ndarray:
    top, bottom, left, right = normalize_pad(pad)
    n, c, h, wd = x_shape
    dxp = np.zeros((n, c, h + top + bottom, wd + left + right), dy.dtype)
    r, s = w.shape[4:6]
    for p in range(dy.shape[2]):
        for q in range(dy.shape[3]):
            window = dxp[:, :, p * stride : p * stride + r, q * stride : q * stride + s]
            window += np.tensordot(dy[:, :, p, q], _weights_at(w, p, q), axes=(1, 0))
    return dxp[:, :, top : top + h, left : left + wd]


def filter_backward_filter(
    dy: np.ndarray,
    x: np.ndarray,
    w_shape: tuple[int, ...],
    stride: int = 1,
    pad=0,
    channels: tuple[int, int] | None = None,
) -> np.ndarray:
    lo, hi = channels if channels is not None else (0, x.shape[1])
    xp = _padded(x[:, lo:hi], pad)
    k, _, _, _, r, s, wp, wq = w_shape
    dw = np.zeros((k, 1, 1, hi - lo, r, s, wp, wq), dy.dtype)
    untied = (wp, wq) != (1, 1)
    for p in range(dy.shape[2]):
        for q in range(dy.shape[3]):
            window = xp[:, :, p * stride : p * stride + r, q * stride : q * stride + s]
            dw_pq = np.tensordot(dy[:, :, p, q], window, axes=(0, 0))  # (K, C, R, S)
            dw[:, 0, 0, :, :, :, p if untied else 0, q if untied else 0] += dw_pq
    return dw


def filter_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    stride: int = 1,
    pad=0,
    channels: tuple[int, int] | None = None,
    need_dx: bool = True,
) -> tuple[np.ndarray | None, np.ndarray]:
    dx = filter_backward_data(dy, x.shape, w, stride, pad) if need_dx else None
    return dx, filter_backward_filter(dy, x, w.shape, stride, pad, channels)


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1, pad=0) -> np.ndarray:
    return filter_forward(x, w, stride, pad) + b


def conv_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    dx, dw = filter_backward(dy, x, w, stride, pad, need_dx=need_dx)
    return dx, dw, dy.sum(axis=(0, 2, 3)).reshape(1, -1, 1, 1)
