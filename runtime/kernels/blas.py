"""GEMM on strided views, callable from Numba, and the BLAS thread policy of the kernels.

`gemm` multiplies row-major sub-matrices given as (array, element offset, leading dimension),
so a kernel can hand BLAS a window of a larger tensor without copying it. It calls
`numba_xxgemm`, the C helper behind Numba's own `np.dot`, which dispatches to SciPy's BLAS
(`scipy.linalg.cython_blas`). The helper is resolved by symbol name when the code is linked,
not baked in as an address, so functions that use `gemm` can be cached (`cache=True`).
Row-major C = op(A)·op(B) is computed as the column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ.

Kernels run each GEMM on one BLAS thread inside Numba's threads: BLAS threads inside Numba
threads would oversubscribe the cores. `parallel_gemm` splits one large product (the `linear`
kernels) into single-threaded blocks on Numba's threads, so that a training step keeps a single
thread pool busy: Numba's. With BLAS's own threads in the mix, each pool's workers spin-wait for
a while after their work and starve the other's: on 2 cores, alternating a NumPy matmul with a
Numba parallel loop measured 8.8 ms a round against 0.06 ms for the same work on one pool. (The
filter kernels do not use BLAS: their small per-position products run on `microkernel`.)

`kernel_threading()` pins every BLAS library in the process to one thread while a kernel runs
(about 12 µs to enter) and restores the previous setting when the outermost one exits. It is
re-entrant and shared by threads, so an executor can hold it for a whole step and the kernels'
own entries inside cost nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from numba import njit, prange, types
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


_TRANS_CODE = ord("T")  # a plain int: a NumPy scalar global would stop Numba caching
# Below these a block is not worth a thread: BLAS runs far below its peak on it.
_MIN_BLOCK = 8
_MIN_BLOCK_MULADDS = 1 << 18


@njit(cache=True, nogil=True)
def gemm_blocks(m, n, k, threads):
    """How many blocks `parallel_gemm` cuts an m×n×k product into: one per thread, fewer when
    C is too narrow or the product too small for a block to be worth a thread."""
    worth = (m * n * k) // _MIN_BLOCK_MULADDS
    return max(1, min(threads, max(m, n) // _MIN_BLOCK, worth))


@njit(cache=True, nogil=True, parallel=True)
def parallel_gemm(
    trans_a, trans_b, m, n, k, a, a_off, lda, b, b_off, ldb, accumulate, c, c_off, ldc, threads
):
    """`gemm` split into `threads` blocks of C's rows (or columns, when C is wider than tall),
    each one single-threaded BLAS call on a Numba thread.

    `threads` is `numba.get_num_threads()` from the caller: read inside, it would stop caching.
    """
    by_rows = m >= n
    extent = m if by_rows else n
    blocks = gemm_blocks(m, n, k, threads)
    for block in prange(blocks):
        lo = extent * block // blocks
        hi = extent * (block + 1) // blocks
        if by_rows:
            a_at = a_off + lo * (1 if trans_a == _TRANS_CODE else lda)
            gemm(trans_a, trans_b, hi - lo, n, k, a, a_at, lda, b, b_off, ldb,
                 accumulate, c, c_off + lo * ldc, ldc)  # fmt: skip
        else:
            b_at = b_off + lo * (ldb if trans_b == _TRANS_CODE else 1)
            gemm(trans_a, trans_b, m, hi - lo, k, a, a_off, lda, b, b_at, ldb,
                 accumulate, c, c_off + lo, ldc)  # fmt: skip


class _Pinning:
    """Process-wide, re-entrant: BLAS pinned to one thread while any holder is inside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.controller = None
        self.restore = None

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                if self.controller is None:
                    from threadpoolctl import ThreadpoolController

                    self.controller = ThreadpoolController().select(user_api="blas")
                self.restore = self.controller.limit(limits=1)
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                restore, self.restore = self.restore, None
                restore.restore_original_limits()


_pinning = _Pinning()


@contextmanager
def kernel_threading() -> Iterator[None]:
    """Run the enclosed kernels (or a whole step) with every BLAS library on one thread."""
    _pinning.enter()
    try:
        yield
    finally:
        _pinning.exit()
