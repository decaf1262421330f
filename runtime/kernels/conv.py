"""The `conv` op: a tied filter plus a per-output-channel bias b of shape (1, K, 1, 1).

Built on the filter kernels; w must be tied, (K, 1, 1, C, R, S, 1, 1). The bias is the same
array in both layouts: it broadcasts over (N, K, P, Q) as (1, K, 1, 1) and over the packed
(P, Q, K, N) as (K, 1), so an executor keeps it as is.

A 1×1 window without padding (ResNet's bottlenecks and shortcuts) is a product per sample,
weights (K × C) by the sample's channels and positions (C × P·Q, every stride-th row and
column), which `pointwise_forward` takes in the logical layout on the linear layer's tiled
product (`linear.product`), and its input's gradient (`pointwise_backward_data`) the transposed
weights by the output gradient's: the packed kernel takes one product a position, as wide as the
batch, and ran ResNet-50's 1×1 convs at batch 8 at 26–61 GFLOP/s on a 2-core VM whose SGEMM is
199 (at batch 64, 43–117 GFLOP/s, where these ran at 112–186).
"""

from __future__ import annotations

import numpy as np

from runtime.kernels import _checks
from runtime.kernels.blas import NO_TRANS, TRANS
from runtime.kernels.filter import filter_backward, filter_forward, filter_geometry
from runtime.kernels.filter_packed import (
    backward_data_packed,
    backward_filter_packed,
    forward_packed,
)
from runtime.kernels.geometry import check_dtypes, check_ndim
from runtime.kernels.linear import product


def _check_bias(b: np.ndarray, k: int, **same_dtype: np.ndarray) -> None:
    if b.shape != (1, k, 1, 1):
        raise ValueError(f"b: expected (1, K, 1, 1) = {(1, k, 1, 1)}, got shape {b.shape}")
    check_dtypes(**same_dtype, b=b)


def _check_tied(w_positions: tuple[int, ...]) -> None:
    if w_positions != (1, 1):
        raise ValueError(f"w: conv weights must be tied (P = Q = 1), got P, Q = {w_positions}")


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1, pad=0) -> np.ndarray:
    """y (N, K, P, Q) = conv of x (N, C, H, W) by w (K, 1, 1, C, R, S, 1, 1), plus b."""
    geo = filter_geometry(x, w, stride, pad)
    _check_tied(w.shape[6:])
    _check_bias(b, geo.k, x=x)
    y = filter_forward(x, w, stride, pad)
    y += b
    return y


def conv_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, dw, db) for the incoming gradient dy (N, K, P, Q); dx is None unless `need_dx`."""
    filter_geometry(x, w, stride, pad)
    _check_tied(w.shape[6:])
    dx, dw = filter_backward(dy, x, w, stride, pad, need_dx=need_dx)
    return dx, dw, dy.sum(axis=(0, 2, 3)).reshape(1, -1, 1, 1)


def conv_forward_packed(
    xp: np.ndarray, wp: np.ndarray, b: np.ndarray, stride: int = 1, pad=0
) -> np.ndarray:
    """y (P, Q, K, N) from x (H, W, C, N), tied weights (1, R, 1, K, S, C) and b (1, K, 1, 1)."""
    check_ndim("wp", wp, 6, "(1, R, 1, K, S, C)")
    _check_tied((wp.shape[0], wp.shape[2]))
    yp = forward_packed(xp, wp, stride, pad)
    _check_bias(b, yp.shape[2], xp=xp)
    yp += b.reshape(-1, 1)
    return yp


def conv_backward_packed(
    dyp: np.ndarray, xp: np.ndarray, wp: np.ndarray, stride: int = 1, pad=0, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dxp, dwp, db) in the packed layouts for dy (P, Q, K, N)."""
    check_ndim("wp", wp, 6, "(1, R, 1, K, S, C)")
    _check_tied((wp.shape[0], wp.shape[2]))
    dxp = None
    if need_dx:
        dxp = backward_data_packed(dyp, wp, xp.shape[:2], stride, pad)
    window = (wp.shape[1], wp.shape[4])
    dwp = backward_filter_packed(dyp, xp, window, stride, pad, untied=False)
    return dxp, dwp, dyp.sum(axis=(0, 1, 3)).reshape(1, -1, 1, 1)


def runs_pointwise(kernel, pad, untied: bool = False) -> bool:
    """Whether a conv's forward runs as a product per sample (`pointwise_forward`): a tied 1×1
    window without padding."""
    return not untied and tuple(kernel) == (1, 1) and not any(pad)


def _pointwise_weights(wp: np.ndarray, filters: int | None = None, channels: int | None = None):
    """The (K × C) matrix of packed 1×1 weights (1, 1, 1, K, 1, C), C-contiguous, checked
    against the `filters` (K) and `channels` (C) of the operand it multiplies."""
    check_ndim("wp", wp, 6, "(1, 1, 1, K, 1, C)")
    k, c = wp.shape[3], wp.shape[5]
    if wp.shape != (1, 1, 1, k, 1, c) or filters not in (None, k) or channels not in (None, c):
        expected = (1, 1, 1, filters or "K", 1, channels or "C")
        raise ValueError(f"wp: expected {expected}, got shape {wp.shape}")
    return np.ascontiguousarray(wp[0, 0, 0, :, 0, :])


def pointwise_forward(x: np.ndarray, wp: np.ndarray, stride=1) -> np.ndarray:
    """y (N, K, P, Q) of x (N, C, H, W) under packed 1×1 weights (1, 1, 1, K, 1, C), without
    padding: y[n] = w · x[n] over every stride-th row and column (`runs_pointwise`)."""
    check_ndim("x", x, 4, "(N, C, H, W)")
    weights = _pointwise_weights(wp, channels=x.shape[1])
    dtype = check_dtypes(x=x, wp=wp)
    rows, columns = _checks.pair("stride", stride)
    x = x[:, :, ::rows, ::columns]
    n, c, p, q = x.shape
    k = weights.shape[0]
    y = np.empty((n, k, p, q), dtype)
    for sample in range(n):
        inputs = np.ascontiguousarray(x[sample]).reshape(c, p * q)
        product(weights, NO_TRANS, inputs, NO_TRANS, y[sample].reshape(k, p * q))
    return y


def pointwise_backward_data(
    dy: np.ndarray,
    wp: np.ndarray,
    input_size: tuple[int, int],
    stride=1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """dx (N, C, H, W) of a 1×1 conv without padding (`pointwise_forward`) from dy (N, K, P,
    Q): dx[n] = wᵀ · dy[n] at every stride-th row and column, zero between; written into `out`
    where given (the step's buffer), each sample's product straight into it where its rows are
    contiguous."""
    check_ndim("dy", dy, 4, "(N, K, P, Q)")
    weights = _pointwise_weights(wp, filters=dy.shape[1])
    dtype = check_dtypes(dy=dy, wp=wp)
    rows, columns = _checks.pair("stride", stride)
    n, k, p, q = dy.shape
    c = weights.shape[1]
    dense = (rows, columns) == (1, 1)
    if dense and tuple(input_size) != (p, q):
        raise ValueError(f"dy: {p}×{q} positions for a {input_size[0]}×{input_size[1]} input")
    dx = np.empty((n, c, *input_size), dtype) if out is None else out
    if not dense:
        dx[...] = 0
    part = np.empty((c, p * q), dtype)
    for sample in range(n):
        grads = np.ascontiguousarray(dy[sample]).reshape(k, p * q)
        direct = dense and dx[sample].flags.c_contiguous
        into = dx[sample].reshape(c, p * q) if direct else part
        product(weights, TRANS, grads, NO_TRANS, into)
        if not direct:
            dx[sample][:, ::rows, ::columns] = part.reshape(c, p, q)
    return dx
