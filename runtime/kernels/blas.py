"""GEMM on strided views, callable from Numba, and the BLAS thread policy of the kernels.

`gemm` multiplies row-major sub-matrices given as (array, element offset, leading dimension),
so a kernel can hand BLAS a window of a larger tensor without copying it. It calls
`numba_xxgemm`, the C helper behind Numba's own `np.dot`, which dispatches to SciPy's BLAS
(`scipy.linalg.cython_blas`). The helper is resolved by symbol name when the code is linked,
not baked in as an address, so functions that use `gemm` can be cached (`cache=True`).
Row-major C = op(A)·op(B) is computed as the column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ.

The kernels parallelise over output positions with Numba threads and run each GEMM on one
BLAS thread: the per-position GEMMs are small (64×448×64 at batch 64), where one thread per
GEMM is far faster than BLAS's own threading, and BLAS threads inside Numba threads would
oversubscribe the cores. `kernel_threading()` pins every BLAS library in the process to one
thread for the duration of a kernel call (about 15 µs) and restores the previous setting.
Numba's default static schedule (one block of consecutive positions per thread) is kept on
purpose: neighbouring positions share most of their input window, and handing positions out
one at a time measured up to 40% slower (tied backward-filter, batch 64).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from numba import njit, types
from numba.np.linalg import ensure_blas

ensure_blas()  # a clear error if SciPy (hence BLAS for Numba) is missing

# Pointers travel as integers (intp has the width of a pointer on every platform Numba targets).
_XXGEMM = types.ExternalFunction(
    "numba_xxgemm",
    types.intc(
        types.int8,
        types.int8,
        types.int8,  # kind ('s' or 'd'), transa, transb
        types.intp,
        types.intp,
        types.intp,  # m, n, k
        types.intp,
        types.intp,
        types.intp,  # alpha, a, lda
        types.intp,
        types.intp,  # b, ldb
        types.intp,
        types.intp,
        types.intp,  # beta, c, ldc
    ),
)

NO_TRANS = np.int8(ord("N"))
TRANS = np.int8(ord("T"))


@njit(cache=True, nogil=True)
def gemm(trans_a, trans_b, m, n, k, a, a_off, lda, b, b_off, ldb, accumulate, c, c_off, ldc):
    """C[c_off:] (m×n, ld ldc) = op(A)·op(B) (+ C if `accumulate`); offsets and lds in elements.

    op(A) is m×k and op(B) is k×n; A is stored m×k (or k×m when transposed), row-major.
    """
    size = a.itemsize
    consts = np.empty(2, a.dtype)
    consts[0] = 0
    consts[1] = 1
    one = consts.ctypes.data + size
    beta = one if accumulate else consts.ctypes.data
    kind = np.int8(ord("s")) if size == 4 else np.int8(ord("d"))
    _XXGEMM(
        kind,
        trans_b,
        trans_a,
        n,
        m,
        k,
        one,
        b.ctypes.data + b_off * size,
        ldb,
        a.ctypes.data + a_off * size,
        lda,
        beta,
        c.ctypes.data + c_off * size,
        ldc,
    )


_controller = None


@contextmanager
def kernel_threading() -> Iterator[None]:
    """Run the enclosed kernel with every BLAS library limited to one thread."""
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController().select(user_api="blas")
    with _controller.limit(limits=1):
        yield
