"""The process-wide BLAS pinning is re-entrant and restores the setting when the last holder
exits."""

import threading

from threadpoolctl import threadpool_info

from runtime.kernels.blas import kernel_threading


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
