"""The `linear` op: y (N, M, 1, 1) = flatten(x) · flatten(w)ᵀ (+ b).

x is (N, C, H, W) and w is (M, C, H, W), so a fully connected layer keeps the logical layout of
the activation it reads and the partitioner can split w along M (model parallel) or x along N
(data parallel) with plain rects. The work is three GEMMs, so these kernels hand reshaped views
to BLAS through np.dot rather than loop in Numba; reshape only copies when a piece is a
non-contiguous slice. On a batch piece dw and db are that piece's contributions (the runtime adds
them); on an M piece dx is the piece's contribution to the input gradient.
"""

from __future__ import annotations

import math

import numpy as np

from runtime.kernels import _checks


def _check(x: np.ndarray, w: np.ndarray) -> None:
    _checks.floating("x", x, 4)
    _checks.floating("w", w, 4)
    _checks.same_dtype("w", w, "x", x)
    if x.shape[1:] != w.shape[1:]:
        raise ValueError(f"w shape {w.shape} does not match x shape {x.shape} in (C, H, W)")


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """y (N, M, 1, 1) = x·wᵀ (+ b) for x (N, C, H, W), w (M, C, H, W), b (1, M, 1, 1)."""
    _check(x, w)
    n, m, chw = x.shape[0], w.shape[0], math.prod(x.shape[1:])
    y = np.empty((n, m, 1, 1), x.dtype)
    np.dot(x.reshape(n, chw), w.reshape(m, chw).T, out=y.reshape(n, m))
    if b is not None:
        _checks.floating("b", b)
        _checks.shape("b", b, (1, m, 1, 1))
        y += b.astype(x.dtype, copy=False)
    return y


def linear_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    need_dx: bool = True,
    need_db: bool = False,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(dx, dw, db): dx = dy·w (N, C, H, W), dw = dyᵀ·x (M, C, H, W), db = Σ_n dy (1, M, 1, 1)."""
    _check(x, w)
    n, m, chw = x.shape[0], w.shape[0], math.prod(x.shape[1:])
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, (n, m, 1, 1))
    _checks.same_dtype("dy", dy, "x", x)
    dy2 = dy.reshape(n, m)
    dw = np.empty(w.shape, w.dtype)
    np.dot(dy2.T, x.reshape(n, chw), out=dw.reshape(m, chw))
    dx = None
    if need_dx:
        dx = np.empty(x.shape, x.dtype)
        np.dot(dy2, w.reshape(m, chw), out=dx.reshape(n, chw))
    db = dy2.sum(axis=0, dtype=np.float64).astype(dy.dtype).reshape(1, m, 1, 1) if need_db else None
    return dx, dw, db


def linear_weight_grad_accumulate(dy: np.ndarray, x: np.ndarray, dw: np.ndarray) -> None:
    """dw += dyᵀ·x in place, for a C-contiguous dw (M, C, H, W), with no dw-sized temporary.

    A classifier's weight gradient is as large as its weights (the seed's is 0.6 GB), so the
    reduction is one GEMM with beta = 1 writing into dw itself: dw viewed transposed,
    (C·H·W, M), is Fortran-ordered, which is what BLAS updates in place.
    """
    from scipy.linalg import blas

    _checks.floating("dy", dy, 4)
    _check(x, dw)
    n, m, chw = x.shape[0], dw.shape[0], math.prod(x.shape[1:])
    _checks.shape("dy", dy, (n, m, 1, 1))
    if not dw.flags.c_contiguous:
        raise ValueError(
            f"dw must be C-contiguous to accumulate in place, got strides {dw.strides}"
        )
    if n == 0:
        return
    gemm = blas.dgemm if dw.dtype == np.float64 else blas.sgemm
    target = dw.reshape(m, chw).T  # (CHW, M), Fortran-ordered: updated in place
    # x2ᵀ is a Fortran-ordered view of x, so BLAS reads it without a copy.
    x2t = np.ascontiguousarray(x.reshape(n, chw)).T
    result = gemm(1.0, x2t, dy.reshape(n, m), beta=1.0, c=target, overwrite_c=True)
    if not np.shares_memory(result, dw):  # BLAS had to copy: keep the result all the same
        target[...] = result
