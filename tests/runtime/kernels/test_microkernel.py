"""The generated register-tiled GEMM against NumPy, on every tile shape and row width."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.aligned import aligned_empty
from runtime.kernels.gemm_tile import MAX_ROWS, MAX_VECTORS, lanes
from runtime.kernels.microkernel import (
    COLUMN_BLOCKS_BEYOND,
    COLUMNS_OUTERMOST_MOST_BYTES,
    PANEL_BYTES,
    PANEL_LEAST_DEPTH,
    STREAM,
    _block_columns,
    _columns_outermost,
    _panels,
    _rows_read,
    kernels,
    tiled_gemm,
    tiled_gemm_prefetching,
    tiled_gemm_sum,
)

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 1e-5, np.float64: 1e-13}


def run(m, n, k, dtype, a_transposed, accumulate, seed=0, margin=3):
    """tiled_gemm into the middle of a larger C, from offsets into larger A and B; returns
    (C after, C before, the expected product block)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m + margin) if a_transposed else (m, k + margin)).astype(dtype)
    b = rng.standard_normal((k, n + 2 * margin)).astype(dtype)
    c = rng.standard_normal((m + 1, n + 2 * margin)).astype(dtype)
    before = c.copy()
    ld_a = a.shape[1]
    a_rs, a_cs = (1, ld_a) if a_transposed else (ld_a, 1)
    a_view = a[:, margin : margin + m].T if a_transposed else a[:, margin : margin + k]
    ldb, ldc = b.shape[1], c.shape[1]
    tiled_gemm(
        kernels(dtype),
        m,
        n,
        k,
        a,
        margin,
        a_rs,
        a_cs,
        b,
        margin,
        ldb,
        accumulate,
        c,
        ldc + margin,
        ldc,
    )
    expected = a_view.astype(np.float64) @ b[:, margin : margin + n].astype(np.float64)
    if accumulate:
        expected += before[1:, margin : margin + n]
    return c, before, expected


def check(c, before, expected, m, n, dtype, margin=3):
    block = c[1 : m + 1, margin : margin + n]
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(block, expected, rtol=0, atol=TOL[dtype] * scale)
    outside = np.ones(c.shape, bool)
    outside[1 : m + 1, margin : margin + n] = False
    np.testing.assert_array_equal(c[outside], before[outside])


def widths(dtype):
    """Row widths that reach every body: whole blocks, each count of leftover whole vectors,
    and a masked tail of each length (alone and after whole vectors)."""
    v = lanes(np.dtype(dtype).itemsize)
    block = MAX_VECTORS * v
    found = {1, v - 1, v, v + 1, block, block + v, 2 * block + 1}
    found |= {block + j * v + t for j in range(MAX_VECTORS) for t in (0, 1, v - 1)}
    return sorted(w for w in found if w > 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_transposed", [False, True])
def test_every_tile_shape_and_width(dtype, a_transposed):
    for m in range(1, 2 * MAX_ROWS + 2):
        for n in widths(dtype):
            for accumulate in (False, True):
                c, before, expected = run(m, n, 5, dtype, a_transposed, accumulate, seed=m * n)
                check(c, before, expected, m, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_either_order_of_the_tiles_gives_the_product(dtype, accumulate):
    """C's tiles down each block of columns (a small result) and across each row tile (a
    large one, past `COLUMNS_OUTERMOST_MOST_BYTES`), masked tails and short last row tiles
    included: each tile is written once, with the product."""
    size = np.dtype(dtype).itemsize
    block = MAX_VECTORS * lanes(size)
    small = (2 * MAX_ROWS + 3, 3 * block + 5)
    large_rows = COLUMNS_OUTERMOST_MOST_BYTES // (small[1] * size) + MAX_ROWS + 1
    for (m, n), down in ((small, True), ((large_rows, small[1]), False)):
        assert _columns_outermost(m, n, block, False, size) is down
        c, before, expected = run(m, n, 7, dtype, False, accumulate, seed=m)
        check(c, before, expected, m, n, dtype)
    # a streamed result goes down the columns whatever its size: it is stored past the caches
    assert _columns_outermost(large_rows, small[1], block, True, size)
    assert not _columns_outermost(large_rows, block, block, True, size)  # one block of columns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [0, 1])
def test_streamed_stores_write_the_product_and_nothing_else(dtype, shift):
    """`STREAM` stores C's whole vectors past the caches where its rows start on vectors (shift
    0: an aligned C whose rows are whole vectors apart), and as `WRITE` does elsewhere (shift
    1): either way C is the product, on every tile shape and width, masked tails included, and
    nothing around it changes."""
    v = lanes(np.dtype(dtype).itemsize)
    rng = np.random.default_rng(5)
    k = 5
    for m in range(1, 2 * MAX_ROWS + 2):
        for n in widths(dtype):
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            ldc = -(-(n + 1) // v) * v
            c = aligned_empty((m + 2, ldc), dtype)
            c[:] = rng.standard_normal(c.shape)
            before = c.copy()
            tiled_gemm(kernels(dtype), m, n, k, a, 0, k, 1, b, 0, n, STREAM, c, ldc + shift, ldc)
            expected = a.astype(np.float64) @ b.astype(np.float64)
            block = (slice(1, m + 1), slice(shift, shift + n))
            scale = max(1.0, float(np.abs(expected).max()))
            np.testing.assert_allclose(c[block], expected, rtol=0, atol=TOL[dtype] * scale)
            outside = np.ones(c.shape, bool)
            outside[block] = False
            np.testing.assert_array_equal(c[outside], before[outside])


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_depth_writes_zeros_or_keeps(dtype):
    c, before, _ = run(7, 19, 0, dtype, False, False)
    check(c, before, np.zeros((7, 19)), 7, 19, dtype)
    c, before, _ = run(7, 19, 0, dtype, False, True)
    check(c, before, before[1:8, 3:22], 7, 19, dtype)


def test_nan_in_c_does_not_survive_an_overwrite():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((13, 9)).astype(np.float32)
    b = rng.standard_normal((9, 37)).astype(np.float32)
    c = np.full((13, 37), np.nan, np.float32)
    tiled_gemm(kernels(np.float32), 13, 37, 9, a, 0, 9, 1, b, 0, 37, False, c, 0, 37)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 140),
    k=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    a_transposed=st.booleans(),
    accumulate=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_agrees_with_numpy(m, n, k, dtype, a_transposed, accumulate, seed):
    c, before, expected = run(m, n, k, dtype, a_transposed, accumulate, seed)
    check(c, before, expected, m, n, dtype)


def test_rejects_mixed_dtypes():
    a = np.ones((2, 2), np.float32)
    b = np.ones((2, 2), np.float64)
    with pytest.raises(Exception, match="(?i)typing|resolution|No implementation"):
        tiled_gemm(kernels(np.float32), 2, 2, 2, a, 0, 2, 1, b, 0, 2, False, a, 0, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("next_ld", [11, 15])
def test_prefetching_the_next_operand_changes_nothing(dtype, next_ld):
    """Hinting the next product's A, 13 rows of 11 elements `next_ld` apart (one run, sent over
    the tiles' steps; or rows apart, sent before each tile), leaves this product as it is."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal(13 * 11 + 13 * next_ld).astype(dtype)  # this product's A, the next
    b = rng.standard_normal((11, 70)).astype(dtype)
    c = np.full((13, 70), np.nan, dtype)
    tiled_gemm_prefetching(
        kernels(dtype), 13, 70, 11, a, 0, 11, 1, b, 0, 70, False, c, 0, 70, 13 * 11, 13, next_ld,
        11,
    )  # fmt: skip
    expected = a[: 13 * 11].reshape(13, 11) @ b
    np.testing.assert_allclose(c, expected, rtol=0, atol=TOL[dtype] * 10)


def test_a_dtype_without_its_compiled_gemm_is_refused():
    a = np.ones((2, 2), np.float64)
    with pytest.raises(ValueError, match="no GEMM compiled"):
        tiled_gemm(np.zeros(2, np.intp), 2, 2, 2, a, 0, 2, 1, a, 0, 2, False, a, 0, 2)
    with pytest.raises(TypeError, match="float32 or float64"):
        kernels(np.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [0, 1, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_a_sum_over_blocks_is_the_sum_of_the_products(dtype, blocks, accumulate):
    """Σ_j A_j·B_j with A_j and B_j further along their arrays by fixed strides (B's backwards),
    as one product; no blocks writes zeros (or keeps C)."""
    rng = np.random.default_rng(blocks)
    m, n, k = 13, 37, 5
    a = rng.standard_normal((4, m, k + 2)).astype(dtype)  # block j is a[j, :, 1:k + 1]
    b = rng.standard_normal((4, k, n + 1)).astype(dtype)  # block j is b[3 - j, :, :n]
    c = rng.standard_normal((m, n + 3)).astype(dtype)
    before = c.copy()
    a_block, b_block = m * (k + 2), -k * (n + 1)
    tiled_gemm_sum(kernels(dtype), m, n, k, blocks, a, 1, k + 2, 1, a_block,
                   b, 3 * k * (n + 1), n + 1, b_block, accumulate, c, 0, n + 3)  # fmt: skip
    expected = sum(
        (a[j, :, 1 : k + 1].astype(np.float64) @ b[3 - j, :, :n] for j in range(blocks)),
        np.zeros((m, n)),
    )
    if accumulate:
        expected += before[:, :n]
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(c[:, :n], expected, rtol=0, atol=TOL[dtype] * scale * 4)
    np.testing.assert_array_equal(c[:, n:], before[:, n:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True, STREAM])
def test_panels_of_the_reduction_sum_to_the_product(dtype, accumulate):
    """A reduction deeper than a panel (`PANEL_LEAST_DEPTH` rows of B here, B's rows as wide as
    `PANEL_BYTES` holds that many of) runs panel by panel, each over every tile: whole blocks
    several to a panel, a block in parts, with a last panel short of the others (a streamed
    result in one panel). Each is the sum of the blocks' products (written, accumulated or
    streamed), and a product of no blocks writes zeros."""
    itemsize = np.dtype(dtype).itemsize
    depth = PANEL_LEAST_DEPTH
    n = PANEL_BYTES // (depth * itemsize)
    m = MAX_ROWS + 1
    rng = np.random.default_rng(11)
    cases = [(depth // 3, 5), (depth, 3), (depth + 1, 2), (2 * depth + 7, 3), (2 * depth + 7, 0),
             (0, 4), (depth + 1, 1)]  # fmt: skip
    for k, blocks in cases:
        a = rng.standard_normal((max(blocks, 1), m, k)).astype(dtype)
        b = rng.standard_normal((max(blocks, 1), k, n)).astype(dtype)
        c = aligned_empty((m, n), dtype)
        c[:] = rng.standard_normal(c.shape)
        before = c.copy()
        tiled_gemm_sum(kernels(dtype), m, n, k, blocks, a, 0, k, 1, m * k, b, 0, n, k * n,
                       accumulate, c, 0, n)  # fmt: skip
        expected = np.einsum("jmk,jkn->mn", a[:blocks].astype(np.float64), b[:blocks])
        if accumulate is True:
            expected += before
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(c, expected, rtol=0, atol=TOL[dtype] * scale * max(k, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True, STREAM])
def test_blocks_of_columns_of_a_wide_result_sum_to_the_product(dtype, accumulate):
    """Where a panel's rows of B outgrow `COLUMN_BLOCKS_BEYOND` and several row tiles read
    them, C is swept in blocks of columns (`_block_columns`), each over every row tile: shallow
    and wide (a weight gradient by its batch), panels and column blocks at once, whole blocks
    several to a panel, a last block of columns short and ending in a masked tail. C beside
    the product is left as it was."""
    itemsize = np.dtype(dtype).itemsize
    block = MAX_VECTORS * lanes(itemsize)
    m = 2 * MAX_ROWS + 1
    rng = np.random.default_rng(12)
    for k, blocks in [(8, 1), (PANEL_LEAST_DEPTH, 1), (2 * PANEL_LEAST_DEPTH + 7, 1), (8, 3)]:
        per_block, steps, _ = _panels(1 << 20, k, blocks, accumulate == STREAM)  # B wide
        rows_read = _rows_read(per_block, steps, k, blocks)
        n = COLUMN_BLOCKS_BEYOND // (rows_read * itemsize) + block + 1  # wide enough to be cut
        columns = _block_columns(m, n, rows_read, itemsize)
        n += n % columns == 0
        assert columns < n and n % columns  # several blocks of columns, the last one short
        a = rng.standard_normal((blocks, m, k)).astype(dtype)
        b = rng.standard_normal((blocks, k, n)).astype(dtype)
        c = aligned_empty((m + 1, n + block), dtype)
        c[:] = rng.standard_normal(c.shape)
        before = c.copy()
        tiled_gemm_sum(kernels(dtype), m, n, k, blocks, a, 0, k, 1, m * k, b, 0, n, k * n,
                       accumulate, c, c.shape[1], c.shape[1])  # fmt: skip
        expected = np.einsum("jmk,jkn->mn", a.astype(np.float64), b)
        if accumulate is True:
            expected += before[1:, :n]
        scale = max(1.0, float(np.abs(expected).max()))
        tolerance = TOL[dtype] * scale * k * blocks
        np.testing.assert_allclose(c[1:, :n], expected, rtol=0, atol=tolerance)
        np.testing.assert_array_equal(c[0], before[0])
        np.testing.assert_array_equal(c[1:, n:], before[1:, n:])


def test_a_wide_result_is_cut_into_blocks_of_columns_only_where_that_saves_reading_b():
    """`_block_columns`: a strip of a weight gradient that steps its weights (16 rows, 8192
    columns, depth 64, float32: B 2 MiB) sweeps B in blocks of `PANEL_BYTES`; one row tile
    reads B once, a B within `COLUMN_BLOCKS_BEYOND` (a forward's panel at its least depth) is
    read whole, and an A too large to read again from L2 keeps the sweep whole."""
    assert _block_columns(16, 8192, 64, 4) == PANEL_BYTES // (64 * 4)
    assert _block_columns(MAX_ROWS, 8192, 64, 4) == 8192
    assert _block_columns(64, 256, PANEL_LEAST_DEPTH, 4) == 256
    assert _block_columns(PANEL_BYTES // (64 * 4) + 1, 8192, 64, 4) == 8192
