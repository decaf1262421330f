import time

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kernels import linear
from runtime.kernels.blas import NO_TRANS
from runtime.kernels.linear import STREAMING_BATCH, linear_backward, linear_forward
from runtime.kernels.update import adam_step
from tests.error_bounds import assert_close_to, assert_product_close
from tests.numeric_grad import assert_grad, numeric_grad


def _inputs(n, m, chw, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *chw)).astype(dtype)
    w = rng.standard_normal((m, *chw)).astype(dtype)
    b = rng.standard_normal((1, m, 1, 1)).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("n", "m", "chw"), [(1, 3, (2, 3, 5)), (4, 7, (3, 1, 1)), (3, 1, (1, 4, 2))]
)
def test_matches_einsum(n, m, chw, dtype):
    x, w, b = _inputs(n, m, chw, dtype)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = np.einsum("nchw,mchw->nm", x64, w64)[:, :, None, None]
    tol = {"rtol": 1e-5, "atol": 1e-5}
    y = linear_forward(x, w)
    assert y.dtype == dtype and y.shape == (n, m, 1, 1)
    np.testing.assert_allclose(y, ref, **tol)
    np.testing.assert_allclose(linear_forward(x, w, b), ref + b, **tol)

    dy = np.random.default_rng(1).standard_normal((n, m, 1, 1)).astype(dtype)
    dx, dw, db = linear_backward(dy, x, w, need_db=True)
    assert dx.dtype == dw.dtype == db.dtype == dtype
    dy2 = dy[:, :, 0, 0].astype(np.float64)
    np.testing.assert_allclose(dx, np.einsum("nm,mchw->nchw", dy2, w64), **tol)
    np.testing.assert_allclose(dw, np.einsum("nm,nchw->mchw", dy2, x64), **tol)
    np.testing.assert_allclose(db, dy2.sum(axis=0).reshape(1, m, 1, 1), **tol)


def test_optional_outputs():
    x, w, _ = _inputs(2, 3, (2, 2, 2), np.float64)
    dy = np.ones((2, 3, 1, 1))
    dx, dw, db = linear_backward(dy, x, w, need_dx=False)
    assert dx is None and db is None
    np.testing.assert_allclose(dw, np.broadcast_to(x.sum(axis=0), w.shape))


def test_numerical_gradients():
    x, w, b = _inputs(3, 4, (2, 3, 2), np.float64)
    r = np.random.default_rng(2).standard_normal((3, 4, 1, 1))
    dx, dw, db = linear_backward(r, x, w, need_db=True)

    def f():
        return linear_forward(x, w, b)

    assert_grad(dx, numeric_grad(f, x, r))
    assert_grad(dw, numeric_grad(f, w, r))
    assert_grad(db, numeric_grad(f, b, r))


def test_pieces_add_up():
    x, w, _ = _inputs(5, 6, (2, 3, 3), np.float64)
    dy = np.random.default_rng(3).standard_normal((5, 6, 1, 1))
    dx, dw, _ = linear_backward(dy, x, w)
    # Batch pieces contribute to dw; output (M) pieces contribute to dx.
    dw_parts = [linear_backward(dy[s], x[s], w)[1] for s in (slice(0, 2), slice(2, 5))]
    # dw sums over the batch (5 terms), dx over the outputs (6): bounds from the terms' sizes
    dy2, x2, w2 = dy.reshape(5, 6), x.reshape(5, -1), w.reshape(6, -1)
    assert_close_to(dw_parts[0] + dw_parts[1], dw, (np.abs(dy2).T @ np.abs(x2)).reshape(w.shape), 6)
    dx_parts = [linear_backward(dy[:, s], x, w[s])[0] for s in (slice(0, 4), slice(4, 6))]
    assert_close_to(dx_parts[0] + dx_parts[1], dx, (np.abs(dy2) @ np.abs(w2)).reshape(x.shape), 7)


def test_strided_piece():
    x, w, _ = _inputs(4, 3, (4, 2, 2), np.float64)
    xs, ws = x[:, 1:3], w[:, 1:3]
    np.testing.assert_allclose(
        linear_forward(xs, ws), np.einsum("nchw,mchw->nm", xs, ws)[:, :, None, None]
    )


def test_bad_arguments():
    x, w, b = _inputs(2, 3, (2, 2, 2), np.float64)
    with pytest.raises(ValueError, match=r"w shape \(3, 2, 2, 1\) does not match x shape"):
        linear_forward(x, w[..., :1])
    with pytest.raises(ValueError, match="w dtype float32"):
        linear_forward(x, w.astype(np.float32))
    with pytest.raises(ValueError, match=r"b must have shape \(1, 3, 1, 1\)"):
        linear_forward(x, w, b.reshape(1, 1, 3, 1))
    with pytest.raises(ValueError, match=r"dy must have shape \(2, 3, 1, 1\)"):
        linear_backward(np.ones((2, 2, 1, 1)), x, w)


def test_empty_batch_piece():
    x, w, _ = _inputs(0, 3, (2, 2, 2), np.float64)
    assert linear_forward(x, w).shape == (0, 3, 1, 1)
    dx, dw, db = linear_backward(np.zeros((0, 3, 1, 1)), x, w, need_db=True)
    assert dx.shape == x.shape
    assert not dw.any() and not db.any() and dw.shape == w.shape


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_grad_accumulates_in_place(dtype):
    from runtime.kernels.linear import linear_weight_grad_accumulate

    rng = np.random.default_rng(3)
    dy = rng.standard_normal((5, 7, 1, 1)).astype(dtype)
    x = rng.standard_normal((5, 3, 2, 2)).astype(dtype)
    dw = rng.standard_normal((7, 3, 2, 2)).astype(dtype)
    expected = dw + np.einsum("nm,nc->mc", dy.reshape(5, 7), x.reshape(5, -1)).reshape(dw.shape)
    address = dw.__array_interface__["data"][0]
    linear_weight_grad_accumulate(dy, x, dw)
    assert dw.__array_interface__["data"][0] == address
    np.testing.assert_allclose(dw, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
    with pytest.raises(ValueError, match="C-contiguous"):
        linear_weight_grad_accumulate(dy, x, np.asfortranarray(dw))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3, STREAMING_BATCH])
@pytest.mark.parametrize("streaming", [True, False])
def test_both_paths_agree_with_einsum_across_chunks(n, dtype, streaming, monkeypatch):
    """The streaming loops and BLAS; a feature count of 2.4 chunks puts a chunk boundary inside
    every row."""
    monkeypatch.setattr(linear, "STREAMING_CHUNK", 25)
    monkeypatch.setattr(linear, "streams", lambda rows, w: streaming)
    x, w, _ = _inputs(n, 3, (2, 5, 6), dtype, seed=n)  # 60 features: chunks of 25, 25, 10
    dy = np.random.default_rng(7).standard_normal((n, 3, 1, 1)).astype(dtype)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy[:, :, 0, 0]))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 0}
    np.testing.assert_allclose(
        linear_forward(x, w)[:, :, 0, 0], np.einsum("nchw,mchw->nm", x64, w64), **tol
    )
    dx = linear.linear_input_grad(dy, w, x.shape)
    assert dx.dtype == dtype
    np.testing.assert_allclose(dx, np.einsum("nm,mchw->nchw", dy64, w64), **tol)


def test_the_loops_stream_only_large_weights_that_blas_cannot_split():
    big = np.empty((10, linear.STREAMING_WEIGHT_BYTES // 40 + 1), np.float32)
    small = np.empty((10, 100, 1, 1), np.float32)
    assert linear.streams(2, big)  # on any thread count: the caller's threads do not decide it
    assert not linear.streams(2, small)
    assert not linear.streams(STREAMING_BATCH + 1, big)
    assert not linear.streams(0, big)
    wide = np.empty((linear.STREAMING_DOTS // 2 + 1, big.shape[1]), np.float32)
    assert not linear.streams(2, wide)  # one dot product at a time: the tiled product wins


def test_the_streaming_forward_does_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(linear, "STREAMING_CHUNK", 1000)
    monkeypatch.setattr(linear, "streams", lambda rows, w: True)
    x, w, _ = _inputs(2, 4, (3, 50, 40), np.float32)  # 6 chunks
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = linear_forward(x, w)
        numba.set_num_threads(threads)
        assert np.array_equal(linear_forward(x, w), one)
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_tiled_products_agree_across_blocks_and_slices(dtype, monkeypatch):
    """Blocks of rows and columns and slices of the reduction small enough that every product
    has several of each, with ragged last ones, and accumulation into the weight gradient."""
    monkeypatch.setattr(linear, "TILED_DEPTH", 7)
    monkeypatch.setattr(linear, "TILED_COLUMNS", 64)
    monkeypatch.setattr(linear, "TILED_BLOCK_BYTES", 7 * 64 * np.dtype(dtype).itemsize)
    x, w, _ = _inputs(21, 130, (3, 5, 6), dtype, seed=5)  # 90 features: slices of 7
    dy = np.random.default_rng(8).standard_normal((21, 130, 1, 1)).astype(dtype)
    xm, wm, dym = x.reshape(21, 90), w.reshape(130, 90), dy.reshape(21, 130)
    assert_product_close(linear_forward(x, w).reshape(21, 130), xm, wm.T, dtype=dtype)
    dx = linear.linear_input_grad(dy, w, x.shape)
    assert_product_close(dx.reshape(21, 90), dym, wm, dtype=dtype)
    dw = np.ones_like(w)
    linear.linear_weight_grad_accumulate(dy, x, dw)
    assert_product_close(dw.reshape(130, 90), dym.T, xm, offset=1.0, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("transposed", [True, False])
def test_the_input_gradient_agrees_in_both_forms(dtype, transposed, monkeypatch):
    """dy·w computed as is and as (wᵀ·dyᵀ)ᵀ, with ragged blocks and slices in both, against
    the product's error bound."""
    monkeypatch.setattr(linear, "TILED_COLUMNS", 64)
    monkeypatch.setattr(linear, "TILED_BLOCK_BYTES", 7 * 64 * np.dtype(dtype).itemsize)
    _, w, _ = _inputs(37, 130, (3, 5, 6), dtype, seed=6)
    dy = np.random.default_rng(9).standard_normal((37, 130)).astype(dtype)
    dx = np.empty((37, 90), dtype)
    linear.product(dy, NO_TRANS, w.reshape(130, 90), NO_TRANS, dx, transposed=transposed)
    assert_product_close(dx, dy, w.reshape(130, 90), dtype=dtype)


#: the hypothesis tests' products: n rows by m outputs by c inputs, float64 or float32, b read
#: in blocks of `columns`
PRODUCT_CASES = {
    "n": st.integers(1, 70),
    "m": st.integers(1, 300),
    "c": st.integers(1, 300),
    "double": st.booleans(),
    "columns": st.sampled_from([64, 256]),
}


@settings(max_examples=25, deadline=None)
@given(**PRODUCT_CASES)
def test_both_orders_of_the_input_gradient_give_the_same_bits(n, m, c, double, columns):
    """The two orders sum each element over the same products in the same order, whatever the
    blocks: which one runs is a matter of speed alone (`linear._raced_input_grad`)."""
    dtype = np.float64 if double else np.float32
    rng = np.random.default_rng(n * 90001 + m * 301 + c)
    dy = rng.standard_normal((n, m)).astype(dtype)
    w = rng.standard_normal((m, c)).astype(dtype)
    as_is, transposed = np.empty((n, c), dtype), np.empty((n, c), dtype)
    saved = linear.TILED_COLUMNS
    linear.TILED_COLUMNS = columns
    try:
        linear.product(dy, NO_TRANS, w, NO_TRANS, as_is)
        linear.product(dy, NO_TRANS, w, NO_TRANS, transposed, transposed=True)
    finally:
        linear.TILED_COLUMNS = saved
    assert np.array_equal(as_is, transposed)


@settings(max_examples=25, deadline=None)
@given(**PRODUCT_CASES)
def test_packed_blocks_of_b_give_the_same_bits_as_b_read_in_place(n, m, c, double, columns):
    """Each slice of b's block copied into a thread's own rows (`linear._packed_product`), or
    all of b into rows a cache line longer (the weight gradient that steps Adam), feeds the
    microkernel the same products in the same order: the forward, both gradients, an
    accumulation and Adam's step give the bits b read in place gives."""
    dtype = np.float64 if double else np.float32
    rng = np.random.default_rng(n * 7919 + m * 31 + c)
    x = rng.standard_normal((n, c, 1, 1)).astype(dtype)
    w = rng.standard_normal((m, c, 1, 1)).astype(dtype)
    dy = rng.standard_normal((n, m, 1, 1)).astype(dtype)
    start = rng.standard_normal(w.shape).astype(dtype)

    def passes() -> list[np.ndarray]:
        dx = np.empty((n, c), dtype)
        linear.product(dy.reshape(n, m), NO_TRANS, w.reshape(m, c), NO_TRANS, dx)
        dw = start.copy()
        linear.linear_weight_grad_accumulate(dy, x, dw)
        stepped, first, second = start.copy(), np.zeros_like(start), np.zeros_like(start)
        linear.linear_weight_grad_step(
            dy, x, adam_step(stepped, first, second, 0.1, 0.9, 0.999, 1e-8, 1)
        )
        return [linear_forward(x, w), dx, dw, stepped, first, second]

    saved = (linear.TILED_COLUMNS, linear.PACKED_STRIDE_BYTES, linear.PACKED_LEAST_BYTES)
    linear.TILED_COLUMNS = columns
    try:
        linear.PACKED_LEAST_BYTES = 1 << 62
        in_place = passes()
        linear.PACKED_STRIDE_BYTES, linear.PACKED_LEAST_BYTES = 1, 0  # every b packed
        packed = passes()
    finally:
        linear.TILED_COLUMNS, linear.PACKED_STRIDE_BYTES, linear.PACKED_LEAST_BYTES = saved
    for got, expected in zip(packed, in_place):
        assert np.array_equal(got, expected)


def test_b_is_packed_where_its_rows_fall_into_few_cache_sets():
    """Packed: a weight beyond the caches whose rows lie a multiple of 8 KiB apart. Read in
    place: the same rows in the caches whole, or a stride that spreads them over the sets."""
    assert linear._packs(np.empty((2048, 2048), np.float32))
    assert linear._packs(np.empty((1024, 4096), np.float32))
    assert linear._packs(np.empty((1024, 1024), np.float64))
    assert not linear._packs(np.empty((512, 512), np.float32))  # in the caches
    assert not linear._packs(np.empty((4096, 1024), np.float32))  # 4 KiB apart
    assert not linear._packs(np.empty((3034, 4666), np.float32))


@pytest.mark.parametrize("slow", [True, False])
def test_the_input_gradient_keeps_the_order_that_ran_faster(slow, monkeypatch):
    """Its first call at a shape that may run transposed races both orders and answers; later
    calls run the faster one, once."""
    monkeypatch.setattr(linear, "_INPUT_GRAD_ORDERS", {})
    product, calls = linear.product, []

    def timed_product(*args, transposed=False, **kwargs):
        calls.append(transposed)
        if transposed == slow:
            time.sleep(0.05)
        product(*args, transposed=transposed, **kwargs)

    monkeypatch.setattr(linear, "product", timed_product)
    rows, outputs, inputs = 2 * linear.VECTOR_BYTES // 4, 1024, 1024
    w = np.random.default_rng(0).standard_normal((outputs, inputs, 1, 1)).astype(np.float32)
    assert linear.may_transpose_input_grad(rows, w)
    dy = np.random.default_rng(1).standard_normal((rows, outputs, 1, 1)).astype(np.float32)
    for call in range(2):
        dx = linear.linear_input_grad(dy, w, (rows, inputs, 1, 1))
        assert_product_close(dx.reshape(rows, inputs), dy.reshape(rows, outputs),
                             w.reshape(outputs, inputs), dtype=np.float32)  # fmt: skip
        assert calls == ([False, True, False] if call == 0 else [not slow])
        calls.clear()


def test_the_input_gradient_may_be_transposed_for_few_rows_of_large_weights():
    large = np.empty((linear.TRANSPOSED_WEIGHT_BYTES // 4096, 1024), np.float32)
    small = np.empty((512, 512), np.float32)
    vector_rows = 2 * linear.VECTOR_BYTES // 4
    assert linear.may_transpose_input_grad(vector_rows, large)
    assert linear.may_transpose_input_grad(linear.INPUT_GRAD_TRANSPOSED_ROWS, large)
    assert not linear.may_transpose_input_grad(vector_rows - 1, large)
    assert not linear.may_transpose_input_grad(linear.INPUT_GRAD_TRANSPOSED_ROWS + 1, large)
    assert not linear.may_transpose_input_grad(vector_rows, small)
