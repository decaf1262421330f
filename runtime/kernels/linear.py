"""The `linear` op: y (N, M, 1, 1) = flatten(x) · flatten(w)ᵀ (+ b).

x is (N, C, H, W) and w is (M, C, H, W), so a fully connected layer keeps the logical layout of
the activation it reads and the partitioner can split w along M (model parallel) or x along N
(data parallel) with plain rects. The work is three GEMMs on the flattened 2-D views, each run by
`blas.parallel_gemm`, so that the layer uses Numba's threads like every other kernel rather than
a second, competing BLAS thread pool. Flattening only copies when a piece is a non-contiguous
slice. On a batch piece dw and db are that piece's contributions (the runtime adds them); on an M
piece dx is the piece's contribution to the input gradient.

At a small batch (`STREAMING_BATCH` rows or fewer) the forward product and the input gradient
read each weight for two or three multiply-adds per row: they are bound by streaming the weights
from memory, and BLAS runs them far from that bound (its GEMM blocks a 14-million-long inner
dimension into short panels; the seed classifier's forward read its 0.57 GB of weights at about
7 GB/s). There they are Numba loops over fixed chunks of the features instead, reading the
weights once at the machine's streaming rate. The forward sums each chunk in float64 and adds the
chunks in order, so the result does not depend on the thread count.

They run only where they win (`streams`): where `parallel_gemm` cannot give every thread a block
of C and the weights are larger than the caches. Measured on 2 cores against `parallel_gemm`,
ten weight rows (`bench/linear_streaming.py`): at batch 2 the loops took 0.22–0.56× BLAS's time
for 5–40 MiB of weights but 1.09–1.32× for 1.25 MiB; at batch 16, where BLAS has a block per
thread, 0.98–1.27×. Where they do not run they are not compiled either, which keeps 3.5 s off a
cold start of the default job.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from runtime.kernels import _checks
from runtime.kernels.blas import NO_TRANS, TRANS, gemm_blocks, kernel_threading, parallel_gemm

#: at or below this many rows the streaming kernels replace the forward and input-gradient GEMMs
STREAMING_BATCH = 16
#: features per chunk of the streaming kernels: a chunk of every row stays in the core's cache
#: while the chunk of each weight row streams past it
STREAMING_CHUNK = 16384
#: weights below this fit the caches, and BLAS reads them as fast as the streaming loops
STREAMING_WEIGHT_BYTES = 4 << 20
_FAST = {"reassoc", "contract"}  # vectorised sums; no change to infinities or NaNs


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _streaming_forward(x, w, chunk):
    """(N, M) float64 = x (N, F) · w (M, F)ᵀ, a chunk of F per task, chunks added in order."""
    n, features = x.shape
    m = w.shape[0]
    chunks = (features + chunk - 1) // chunk
    partial = np.zeros((chunks, n, m))
    for c in prange(chunks):
        lo = c * chunk
        hi = min(features, lo + chunk)
        for i in range(m):
            row = w[i, lo:hi]  # a 1-d slice: the loop below vectorises, 2-d indexing did not
            for r in range(n):
                xs = x[r, lo:hi]
                total = 0.0
                for j in range(hi - lo):
                    total += np.float64(xs[j]) * np.float64(row[j])
                partial[c, r, i] = total
    y = np.zeros((n, m))
    for c in range(chunks):
        y += partial[c]
    return y


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _streaming_input_grad(dy, w, dx, chunk):
    """dx (N, F) = dy (N, M) · w (M, F), a chunk of F per task."""
    n, features = dx.shape
    m = w.shape[0]
    chunks = (features + chunk - 1) // chunk
    for c in prange(chunks):
        lo = c * chunk
        hi = min(features, lo + chunk)
        for r in range(n):
            dx[r, lo:hi] = 0
        for i in range(m):
            row = w[i, lo:hi]
            for r in range(n):
                g = dy[r, i]
                out = dx[r, lo:hi]
                for j in range(hi - lo):
                    out[j] += g * row[j]


def streams(n: int, w: np.ndarray) -> bool:
    """Whether a product of n rows with the weights w runs on the streaming loops."""
    m = w.shape[0]
    features = w.size // m if m else 0
    return (
        0 < n <= STREAMING_BATCH
        and w.nbytes >= STREAMING_WEIGHT_BYTES
        and gemm_blocks(n, m, features, numba.get_num_threads()) < numba.get_num_threads()
    )


def _check(x: np.ndarray, w: np.ndarray) -> None:
    _checks.floating("x", x, 4)
    _checks.floating("w", w, 4)
    _checks.same_dtype("w", w, "x", x)
    if x.shape[1:] != w.shape[1:]:
        raise ValueError(f"w shape {w.shape} does not match x shape {x.shape} in (C, H, W)")


def _matrix(a: np.ndarray, rows: int) -> np.ndarray:
    """`a` as a C-contiguous (rows, rest) matrix: a view when it can be, else a copy."""
    return np.ascontiguousarray(a.reshape(rows, math.prod(a.shape[1:])))


def _product(
    a: np.ndarray, trans_a, b: np.ndarray, trans_b, c: np.ndarray, accumulate: bool = False
) -> None:
    """c (m×n, C-contiguous) (+)= op(a)·op(b) for C-contiguous matrices a and b."""
    m, n = c.shape
    k = a.shape[0] if trans_a == TRANS else a.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            c[...] = 0
        return
    with kernel_threading():
        parallel_gemm(trans_a, trans_b, m, n, k, a, 0, a.shape[1], b, 0, b.shape[1],
                      accumulate, c, 0, n, numba.get_num_threads())  # fmt: skip


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """y (N, M, 1, 1) = x·wᵀ (+ b) for x (N, C, H, W), w (M, C, H, W), b (1, M, 1, 1)."""
    _check(x, w)
    n, m = x.shape[0], w.shape[0]
    y = np.empty((n, m, 1, 1), x.dtype)
    if streams(n, w):
        with kernel_threading():
            y[:, :, 0, 0] = _streaming_forward(_matrix(x, n), _matrix(w, m), STREAMING_CHUNK)
    else:
        _product(_matrix(x, n), NO_TRANS, _matrix(w, m), TRANS, y.reshape(n, m))
    if b is not None:
        _checks.floating("b", b)
        _checks.shape("b", b, (1, m, 1, 1))
        y += b.astype(x.dtype, copy=False)
    return y


def _check_dy(dy: np.ndarray, x: np.ndarray, m: int) -> None:
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, (x.shape[0], m, 1, 1))
    _checks.same_dtype("dy", dy, "x", x)


def linear_input_grad(dy: np.ndarray, w: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """dx (N, C, H, W) = dy·w for dy (N, M, 1, 1) and w (M, C, H, W)."""
    n, m = dy.shape[0], w.shape[0]
    dx = np.empty(input_shape, w.dtype)
    flat = dx.reshape(n, math.prod(input_shape[1:]))
    if streams(n, w):
        with kernel_threading():
            _streaming_input_grad(_matrix(dy, n), _matrix(w, m), flat, STREAMING_CHUNK)
    else:
        _product(_matrix(dy, n), NO_TRANS, _matrix(w, m), NO_TRANS, flat)
    return dx


def linear_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    need_dx: bool = True,
    need_db: bool = False,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(dx, dw, db): dx = dy·w (N, C, H, W), dw = dyᵀ·x (M, C, H, W), db = Σ_n dy (1, M, 1, 1)."""
    _check(x, w)
    n, m = x.shape[0], w.shape[0]
    _check_dy(dy, x, m)
    dw = np.empty(w.shape, w.dtype)
    _product(_matrix(dy, n), TRANS, _matrix(x, n), NO_TRANS, dw.reshape(m, math.prod(w.shape[1:])))
    dx = linear_input_grad(dy, w, x.shape) if need_dx else None
    dy2 = dy.reshape(n, m)
    db = dy2.sum(axis=0, dtype=np.float64).astype(dy.dtype).reshape(1, m, 1, 1) if need_db else None
    return dx, dw, db


def linear_weight_grad_accumulate(
    dy: np.ndarray, x: np.ndarray, dw: np.ndarray, accumulate: bool = True
) -> None:
    """dw += dyᵀ·x in place (dw = dyᵀ·x without `accumulate`), for a C-contiguous dw
    (M, C, H, W), with no dw-sized temporary.

    A classifier's weight gradient is as large as its weights (the seed's is 0.6 GB), so the
    reduction is one GEMM with beta = 1 (0) writing into dw itself.
    """
    _checks.floating("dy", dy, 4)
    _check(x, dw)
    n, m = x.shape[0], dw.shape[0]
    _check_dy(dy, x, m)
    if not dw.flags.c_contiguous:
        raise ValueError(
            f"dw must be C-contiguous to accumulate in place, got strides {dw.strides}"
        )
    _product(
        _matrix(dy, n),
        TRANS,
        _matrix(x, n),
        NO_TRANS,
        dw.reshape(m, math.prod(dw.shape[1:])),
        accumulate=accumulate,
    )
