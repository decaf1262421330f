"""Tied filters on fewer examples than a vector holds: each example's passes as products along
an output row's positions rather than along the batch.

The packed kernels (`filter_packed`) vectorise along the batch, one vector of examples wide: at
one example each output position is a matrix-vector product reading all the weights again
(VGG-19's forward at batch 1 ran at 1.5 GFLOP/s). For one example the positions of an output row
are a product's rows instead: forward Y[p] (Q×K) = Σ_r X_r (Q×S·C) · Wt[r] (S·C×K), the input
gradient per input row and window element, the weight gradient per window element summed over
the output rows. `filter_packed` runs a pass so where `by_example` says, an example at a time
(`operand`, `written`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from numba import prange

from runtime.aligned import aligned_empty
from runtime.kernels.gemm_tile import VECTOR_BYTES
from runtime.kernels.geometry import Geometry
from runtime.kernels.layout import canonical_unit_strides
from runtime.kernels.microkernel import tiled_gemm, tiled_gemm_sum
from runtime.kernels.threaded import threaded
from runtime.kernels.windows import clip, inside, reading_row


@threaded
def forward(x, wt, y, stride, pad_top, pad_left, kernels):
    """`filter_packed._forward` of tied weights for one example (N = 1), whose products along
    the batch would be matrix-vector products, the weights read again at every position: here
    the positions of an output row are the product's rows instead, Y[p] (Q×K) = Σ_r X_r (Q×S·C)
    · Wt[r] (S·C×K), with X_r the input row's windows, one every `stride` columns (the (W, C)
    axes read as one), and Wt the weights (R, S·C, K) with K unit-stride; the positions whose
    window the padding clips are each a product of their own."""
    h, wd, c, _ = x.shape
    p_out, q_out, k, _ = y.shape
    r_size = wt.shape[0]
    s_size = wt.shape[1] // c
    size = x.itemsize
    xs0, xs1, xs2 = x.strides[0] // size, x.strides[1] // size, x.strides[2] // size
    ys0, ys1 = y.strides[0] // size, y.strides[1] // size
    wr, ws = wt.strides[0] // size, wt.strides[1] // size
    # the positions whose window lies inside the input's columns: its first and last column
    q_lo = min(q_out, inside(0, pad_left, wd, stride, q_out)[0])
    q_hi = max(q_lo, min(q_out, inside(s_size - 1, pad_left, wd, stride, q_out)[1]))
    for p in prange(p_out):
        h0 = p * stride - pad_top
        r_lo, r_hi = clip(h0, r_size, h)
        tiled_gemm_sum(kernels, q_hi - q_lo, k, s_size * c, r_hi - r_lo,
                       x, (h0 + r_lo) * xs0 + (q_lo * stride - pad_left) * xs1, stride * xs1,
                       xs2, xs0,
                       wt, r_lo * wr, ws, wr,
                       False, y, p * ys0 + q_lo * ys1, ys1)  # fmt: skip
        for q in range(q_out):
            if q_lo <= q < q_hi:
                continue
            w0 = q * stride - pad_left
            s_lo, s_hi = clip(w0, s_size, wd)
            rows = r_hi - r_lo if s_hi > s_lo else 0
            tiled_gemm_sum(kernels, 1, k, (s_hi - s_lo) * c, rows,
                           x, (h0 + r_lo) * xs0 + (w0 + s_lo) * xs1, xs1, xs2, xs0,
                           wt, r_lo * wr + s_lo * c * ws, ws, wr,
                           False, y, p * ys0 + q * ys1, ys1)  # fmt: skip


@threaded
def backward_data(dy, w, dx, stride, pad_top, pad_left, kernels):
    """`filter_packed._backward_data` of tied weights for one example: each input row is the
    sum, over the window rows r and columns s that reach it, of dY[p] (Q×K) · W[r, s] (K×C) over
    the positions whose window column s lies inside the input, written `stride` columns apart."""
    h, wd, c, _ = dx.shape
    p_out, q_out, k, _ = dy.shape
    r_size, s_size = w.shape[2], w.shape[4]
    size = dx.itemsize
    gs0, gs1, gs2 = dy.strides[0] // size, dy.strides[1] // size, dy.strides[2] // size
    xs0, xs1 = dx.strides[0] // size, dx.strides[1] // size
    ws2, ws3, ws4 = w.strides[2] // size, w.strides[3] // size, w.strides[4] // size
    for row in prange(h):
        dx[row] = 0
        for r in range(r_size):
            p = reading_row(row, r, pad_top, stride, p_out)
            if p < 0:
                continue
            for s in range(s_size):
                q_lo, q_hi = inside(s, pad_left, wd, stride, q_out)
                tiled_gemm(kernels, q_hi - q_lo, c, k,
                           dy, p * gs0 + q_lo * gs1, gs1, gs2,
                           w, r * ws2 + s * ws4, ws3,
                           True, dx, row * xs0 + (q_lo * stride + s - pad_left) * xs1,
                           stride * xs1)  # fmt: skip


@threaded
def backward_filter(dy, x, dw, c_lo, stride, pad_top, pad_left, accumulate, kernels):
    """`filter_packed._backward_filter_tied` for one example: each window element (r, s) of the
    gradient is Σ_p dY[p]ᵀ (K×Q) · X[row p·stride + r − pad] (Q×C) over the output rows and
    columns whose window element lies inside the input, one product whose tile stays in
    registers over the rows; the (r, s) blocks are disjoint, so the threads share no partial
    sums."""
    h, wd, _, _ = x.shape
    p_out, q_out, k, _ = dy.shape
    r_size, s_size, cs = dw.shape[1], dw.shape[4], dw.shape[5]
    size = x.itemsize
    gs0, gs1, gs2 = dy.strides[0] // size, dy.strides[1] // size, dy.strides[2] // size
    xs0, xs1, xs2 = x.strides[0] // size, x.strides[1] // size, x.strides[2] // size
    ds1, ds3, ds4 = dw.strides[1] // size, dw.strides[3] // size, dw.strides[4] // size
    for rs in prange(r_size * s_size):
        r, s = rs // s_size, rs % s_size
        p_lo, p_hi = inside(r, pad_top, h, stride, p_out)
        q_lo, q_hi = inside(s, pad_left, wd, stride, q_out)
        rows = p_hi - p_lo if q_hi > q_lo else 0
        tiled_gemm_sum(kernels, k, cs, q_hi - q_lo, rows,
                       dy, p_lo * gs0 + q_lo * gs1, gs2, gs1, gs0,
                       x, (p_lo * stride + r - pad_top) * xs0
                       + (q_lo * stride + s - pad_left) * xs1 + c_lo * xs2,
                       stride * xs1, stride * xs0,
                       accumulate, dw, r * ds1 + s * ds4, ds3)  # fmt: skip


def by_example(geo: Geometry, dtype, width: int) -> bool:
    """Whether a pass of tied filters runs one example at a time (`forward`, `backward_data`,
    `backward_filter`), whose products run along `width` (the output channels forward, the
    input channels backward) rather than the batch: the batch is narrower than a vector and
    than `width` (VGG-19's 3×3 layers on the 2-core AVX2 VM, float32: along the batch 3 GFLOP/s
    at batch 1, 6 at 2, 12 at 4, 54 at 8; along positions 46–67 at any batch; ResNet's stem,
    3 input channels, takes its gradients along a batch of 4 at 8.5–11 GFLOP/s, along its
    channels at 7.3–7.4)."""
    return not geo.untied and geo.n * np.dtype(dtype).itemsize < VECTOR_BYTES and width > geo.n


def operand(a: np.ndarray, b: int) -> np.ndarray:
    """Example `b` of (H, W, C, N) activations as an operand of one example: its channels
    unit-stride (a copy where the batch is wider)."""
    one = canonical_unit_strides(a[..., b : b + 1])
    return one if _rows_of_channels(one) else canonical_unit_strides(np.ascontiguousarray(one))


@contextmanager
def written(out: np.ndarray, b: int) -> Iterator[np.ndarray]:
    """Example `b` of an output (P, Q, K, N) to write one example's result into: the view
    itself where its channels are unit-stride, else a buffer copied into it after."""
    view = canonical_unit_strides(out[..., b : b + 1])
    if _rows_of_channels(view):
        yield view
        return
    buffer = aligned_empty(view.shape, view.dtype)
    yield buffer
    view[...] = buffer


def _rows_of_channels(one: np.ndarray) -> bool:
    """Whether an example's (H, W, C, 1) view has unit-stride channels and its (W, C) axes
    read as one row: what the kernels here take as it is."""
    return one.strides[2] == one.itemsize and one.strides[1] == one.shape[2] * one.itemsize
