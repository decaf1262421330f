"""`parallel_gemm` against NumPy on every transpose pair, both split directions and offsets;
the process-wide BLAS pinning is re-entrant and restores the setting when the last holder exits."""

import threading

import numba
import numpy as np
import pytest
from error_bounds import assert_product_close
from threadpoolctl import threadpool_info

from runtime.kernels.blas import NO_TRANS, TRANS, kernel_threading, parallel_gemm


def _stored(rng, rows, cols, pad):
    """A row-major (rows, cols) matrix inside a wider, offset buffer: (buffer, offset, ld)."""
    ld = cols + pad
    buffer = rng.standard_normal(3 + rows * ld)
    return buffer, 3, ld, buffer[3:].reshape(rows, ld)[:, :cols]


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("shape", [(600, 9, 200), (9, 2000, 70), (1, 1, 5), (64, 64, 0)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_gemm_matches_numpy(trans_a, trans_b, shape, threads):
    m, n, k = shape
    rng = np.random.default_rng(m * 7 + n)
    a, a_off, lda, a_view = _stored(rng, *((k, m) if trans_a else (m, k)), pad=2)
    b, b_off, ldb, b_view = _stored(rng, *((n, k) if trans_b else (k, n)), pad=1)
    c, c_off, ldc, c_view = _stored(rng, m, n, pad=4)
    before, buffer_before = c_view.copy(), c.copy()
    a_math, b_math = (a_view.T if trans_a else a_view), (b_view.T if trans_b else b_view)
    with kernel_threading():
        parallel_gemm(
            TRANS if trans_a else NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k,
            a, a_off, lda, b, b_off, ldb, True, c, c_off, ldc, threads,
        )  # fmt: skip
    assert_product_close(c_view, a_math, b_math, offset=before)
    outside = np.ones(c.shape, bool)
    outside[c_off:].reshape(m, ldc)[:, :n] = False
    assert np.array_equal(c[outside], buffer_before[outside])  # offsets and padding untouched


def test_parallel_gemm_leaves_padding_alone():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((200, 400)), rng.standard_normal((400, 30))
    c = np.full((200, 33), 7.0)
    with kernel_threading():
        parallel_gemm(NO_TRANS, NO_TRANS, 200, 30, 400, a, 0, 400, b, 0, 30, False, c, 0, 33,
                      numba.config.NUMBA_NUM_THREADS)  # fmt: skip
    assert_product_close(c[:, :30], a, b)
    assert np.all(c[:, 30:] == 7.0)


def _blas_threads():
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


def test_pinning_is_reentrant_across_threads_and_restores():
    original = _blas_threads()
    inside = []
    ready = threading.Barrier(2)

    def holder():
        with kernel_threading():
            ready.wait()
            inside.append(_blas_threads())
            ready.wait()

    with kernel_threading():
        with kernel_threading():
            assert all(n == 1 for n in _blas_threads())
        assert all(n == 1 for n in _blas_threads())  # the inner exit did not restore
        thread = threading.Thread(target=holder)
        thread.start()
        ready.wait()
        ready.wait()
        thread.join()
        assert all(n == 1 for n in _blas_threads())  # the other holder's exit did not either
    assert inside and all(n == 1 for n in inside[0])
    assert _blas_threads() == original
