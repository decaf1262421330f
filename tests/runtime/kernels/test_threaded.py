"""A kernel's twins (`runtime.kernels.threaded`): which one a call runs, their cache entries, and
that on one thread they compute the same bits."""

import numba
import numpy as np
import pytest

from runtime.kernels import filter_packed, layout, linear, nonlinear, softmax, update
from runtime.kernels.threaded import threaded


@threaded
def _scaled_rows(x, y):
    for i in numba.prange(x.shape[0]):
        for j in range(x.shape[1]):
            y[i, j] = 2.0 * x[i, j]


def _on_threads(count: int, fn):
    before = numba.get_num_threads()
    numba.set_num_threads(count)
    try:
        return fn()
    finally:
        numba.set_num_threads(before)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one Numba thread")
def test_a_call_runs_the_plain_loops_on_one_thread_and_the_parallel_ones_on_more():
    x = np.arange(12.0).reshape(3, 4)
    y = np.zeros_like(x)
    assert _on_threads(1, _scaled_rows.current) is _scaled_rows.serial
    assert _on_threads(2, _scaled_rows.current) is _scaled_rows.parallel
    _on_threads(1, lambda: _scaled_rows(x, y))
    assert _scaled_rows.serial.signatures and not _scaled_rows.parallel.signatures
    np.testing.assert_array_equal(y, 2.0 * x)
    _on_threads(2, lambda: _scaled_rows(x, y))
    assert _scaled_rows.parallel.signatures


def test_the_twins_are_cached_apart():
    """Numba names a cache entry by the function's qualified name: one name for both would load
    one twin's code for the other."""
    kernel = softmax._row_pass
    assert kernel.serial.py_func.__qualname__ == kernel.parallel.py_func.__qualname__ + "_serial"
    assert kernel.serial.py_func.__code__ is kernel.parallel.py_func.__code__
    assert kernel.serial._cache._cache_file._index_name != (
        kernel.parallel._cache._cache_file._index_name
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_on_one_thread_the_twins_compute_the_same_bits(dtype, monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 6, 6)).astype(dtype)
    w = rng.standard_normal((4, 1, 1, 3, 3, 3, 4, 4)).astype(dtype)
    xp, wp = layout.pack_activations(x), layout.pack_weights(w)
    flat = rng.standard_normal(40_000).astype(dtype)
    long = rng.standard_normal(3 * update.CHUNK + 5).astype(dtype)
    rows = rng.standard_normal((3, 40_000)).astype(dtype)
    columns = rng.standard_normal((10, 40_000)).astype(dtype)
    cases = [
        (filter_packed, "_forward", lambda: filter_packed.forward_packed(xp, wp, 1, 0)),
        (nonlinear, "_elementwise", lambda: nonlinear.filterNL_forward(flat, "tanh")),
        (update, "_sum_squares_chunked", lambda: update._sum_squares_chunked(long)),
        # fastmath's reassoc: LLVM may vectorise each twin's sums its own way
        (linear, "_streaming_forward", lambda: linear._streaming_forward(rows, columns, 4096)),
    ]
    for module, name, call in cases:
        kernel = getattr(module, name)
        found = []
        for twin in (kernel.serial, kernel.parallel):
            monkeypatch.setattr(module, name, twin)
            found.append(_on_threads(1, call))
        monkeypatch.setattr(module, name, kernel)
        np.testing.assert_array_equal(found[0], found[1], err_msg=f"{module.__name__}.{name}")


def test_an_inner_kernel_runs_inside_kernels_and_refuses_a_call_from_python():
    """The sigmoid is compiled without a wrapper for Python's arguments: the nonlinearity's
    loops call it, and a call from Python is a TypeError rather than a crash."""
    x = np.array([-800.0, -1.5, 0.0, 2.0, 800.0]).reshape(5, 1, 1, 1)
    y = nonlinear.filterNL_forward(x, "sigmoid")
    with np.errstate(over="ignore"):
        expected = 1.0 / (1.0 + np.exp(-x))
    np.testing.assert_allclose(y, expected, rtol=4 * np.finfo(np.float64).eps, atol=0)
    with pytest.raises(TypeError, match="other kernels only"):
        nonlinear._sigmoid(0.5)
