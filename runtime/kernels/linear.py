"""The `linear` op: y (N, M, 1, 1) = flatten(x) · flatten(w)ᵀ (+ b).

x is (N, C, H, W) and w is (M, C, H, W), so a fully connected layer keeps the logical layout of
the activation it reads and the partitioner can split w along M (model parallel) or x along N
(data parallel) with plain rects. The work is three GEMMs on the flattened 2-D views, run on the
filter kernels' GEMM (`microkernel.tiled_gemm`) in blocks of the result on Numba's threads
(`_tiled_product`), like every other kernel, rather than on a second, competing BLAS thread
pool. The weight and input gradients' right operands (x and w) have unit-stride rows as they
are; the forward computes yᵀ = w·xᵀ, with xᵀ copied (activation-sized, against the weights it
streams). A right operand whose rows lie a large power of two apart (a 2048-wide weight) is
read through a copy whose rows do not share the caches' sets (`_packs`). Each
element of a result is summed by one thread in one order, whatever the thread count. At the
seed classifier's shape (batch 64, 3034 × 46656 weights, 2 cores) the forward, weight and input
gradients ran at 216, 181 and 190 GFLOP/s, where `parallel_gemm` blocks of
SciPy's OpenBLAS 0.3.30 had run at 161, 151 and 117; b read in blocks of 256 columns rather
than 64 (`TILED_COLUMNS`) later took the input gradient to 0.88 of its time at that shape and
the weight gradient to 0.69–0.74. Flattening only copies when a piece is a
non-contiguous slice. On a batch piece dw and db are that piece's contributions (the runtime
adds them); on an M piece dx is the piece's contribution to the input gradient.

At a small batch the forward reads each weight for two or three multiply-adds per row: it is
bound by streaming the weights from memory, and a GEMM's tiles, as wide as the batch, run far
from that bound. There it is a Numba loop over fixed chunks of the features instead, reading the
weights once at the machine's streaming rate; it sums each chunk in float64 and adds the chunks
in order, so the result does not depend on the thread count. It runs only where it wins
(`streams`: `STREAMING_BATCH` rows or fewer, `STREAMING_DOTS` row-output pairs or fewer,
weights beyond the caches). Measured on 2 cores, ten weight rows (`bench/linear_streaming.py`):
the tiled forward took 1.9–5.6× the loop's time at batches 2 and 16 for 1.25–40 MiB of weights,
and 1.0–2.2× for 0.12 MiB, where both take 15–72 us; on another machine 1.2–3.0× at 1.25–40
MiB. The loop's time grows with the rows times the outputs: at 32 outputs the tiled product
took 1.3–1.8× the loop's time at batch 2 and 0.3–0.6× at 16; at 2048 outputs (a pipeline's
micro-batch of 16 rows through a 2048-wide layer) 0.5× at batch 2 and 0.08–0.1× at 16. Below
the threshold the loop is not compiled either, which keeps 3.5 s off a cold start of the
default job. (The input gradient had a streaming loop of its own too; the tiled
product ran it in 0.3–0.8× that loop's time at every one of these shapes.)
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np
from numba import prange

from runtime.aligned import aligned_empty, scratch_empty
from runtime.kernels import _checks
from runtime.kernels.blas import NO_TRANS, TRANS
from runtime.kernels.gemm_tile import VECTOR_BYTES
from runtime.kernels.llvm_memory import copy_run
from runtime.kernels.microkernel import kernels, tiled_gemm
from runtime.kernels.threaded import threaded
from runtime.kernels.update import OptimizerStep, run_view, step_elements

#: at or below this many rows the streaming loop replaces the forward's GEMM
STREAMING_BATCH = 16
#: features per chunk of the streaming kernels: a chunk of every row stays in the core's cache
#: while the chunk of each weight row streams past it
STREAMING_CHUNK = 16384
#: weights below this fit the caches, where the loop's gain is microseconds
STREAMING_WEIGHT_BYTES = 1 << 20
#: at most this many dot products (rows times outputs): the loop does one at a time, so its
#: time grows with the rows times the outputs, where the tiled product's barely does
STREAMING_DOTS = 256
_FAST = {"reassoc", "contract"}  # vectorised sums; no change to infinities or NaNs


@threaded(fastmath=_FAST)
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


def streams(n: int, w: np.ndarray) -> bool:
    """Whether the forward of n rows with the weights w runs on the streaming loop."""
    return (
        0 < n <= STREAMING_BATCH
        and n * w.shape[0] <= STREAMING_DOTS
        and w.nbytes >= STREAMING_WEIGHT_BYTES
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


def product(
    a: np.ndarray,
    trans_a,
    b: np.ndarray,
    trans_b,
    c: np.ndarray,
    accumulate: bool = False,
    transposed: bool = False,
) -> None:
    """c (m×n, C-contiguous) (+)= op(a)·op(b) for C-contiguous matrices a and b; computed as
    cᵀ = op(b)ᵀ·op(a)ᵀ where b is transposed, or where `transposed` asks (few rows of a against
    a large b, which the microkernel then reads in place)."""
    m, n = c.shape
    k = a.shape[0] if trans_a == TRANS else a.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            c[...] = 0
        return
    if trans_b == TRANS or transposed:  # op(b)ᵀ read through strides; op(a)ᵀ made unit-stride
        right = a if trans_a == TRANS else np.ascontiguousarray(a.T)
        result = np.empty((n, m), c.dtype)
        _tiled(b, NO_TRANS if trans_b == TRANS else TRANS, right, result, False)
        if accumulate:
            c += result.T
        else:
            c[...] = result.T
        return
    _tiled(a, trans_a, b, c, accumulate)


def _tiled(
    a: np.ndarray,
    trans_a,
    b: np.ndarray,
    c: np.ndarray,
    accumulate: bool,
    step: OptimizerStep | None = None,
) -> None:
    """c (+)= op(a)·b on the tiled GEMM, for C-contiguous a, b (k×n) and c (m×n); with a
    `step` over (m×n) C-contiguous parameters, the product is their gradient, stepped block
    by block, and c is not written."""
    m, n = c.shape
    k = b.shape[0]
    a_rs, a_cs = (1, m) if trans_a == TRANS else (k, 1)
    if step is None:
        columns = min(TILED_COLUMNS, -(-n // 64) * 64)
        depth = min(k, max(1, TILED_BLOCK_BYTES // (columns * c.itemsize)))
    else:
        depth = min(k, TILED_DEPTH)
        columns = max(64, STEP_BLOCK_BYTES // (depth * c.itemsize) // 64 * 64)
    # enough row blocks for every thread where c is too narrow for a column block each: each
    # row block reads all of b again
    column_blocks = -(-n // columns)
    tasks = TILED_TASKS_PER_THREAD * numba.get_num_threads()
    row_blocks = max(1, min(-(-m // 6), -(-tasks // column_blocks)))
    rows = -(-m // row_blocks)
    threads = numba.config.NUMBA_NUM_THREADS
    if step is None:
        if _packs(b):
            packed = aligned_empty((threads, depth * (columns + PACKED_PAD)), c.dtype)
            _packed_product(kernels(c.dtype), m, n, k, a, a_rs, a_cs, b, accumulate, c, depth,
                            columns, rows, packed)  # fmt: skip
        else:
            _tiled_product(kernels(c.dtype), m, n, k, a, a_rs, a_cs, b, accumulate, c, depth,
                           columns, rows)  # fmt: skip
        return
    operands = tuple(o.reshape(m, n) for o in step.operands)
    scratch = aligned_empty((threads, STEP_ROWS * min(columns, n)), c.dtype)
    ldb = n
    # all of b copied once, rows a cache line longer (`_packs`), where `_packed_product` copies
    # each slice of a block into the cache: every strip of the step reads each slice of b again,
    # and b (x) serves all m rows of the gradient, so one pass over it through memory costs
    # little here, while the input gradient's b serves a few rows of dx (copying a 2048 × 2048
    # w alone, block by block, took 2.4 ms against 3.1–3.4 ms for its 32-row product)
    if _packs(b):
        ldb = n + PACKED_PAD
        padded = scratch_empty("b, rows padded", (k, ldb), b.dtype)
        padded[:, :n] = b
        b = padded
    _stepped_product(kernels(c.dtype), m, n, k, a, a_rs, a_cs, b, ldb, depth, columns, rows,
                     step.rule, step.coefficients, *operands, scratch)  # fmt: skip


#: the bytes of b's block (a slice of the reduction by a block of columns) that the tiled
#: product reads while every row tile of A passes it: it stays in the core's cache
TILED_BLOCK_BYTES = 256 << 10
#: the block's columns where b has them, its depth then what fills TILED_BLOCK_BYTES. Rows of
#: 1 KiB (16 cache lines) let the prefetchers stream a wide b (a weight read by the input's
#: gradient, dx = dy·w), where 64 columns 1024 deep had them fetch 4 lines a row, each row a page
#: apart. Measured on 2 cores (1 thread, and 2; `bench/linear_blocks.py`): dy·w at 32 and 128
#: rows, w 2048×2048, 4096×1024 and 1024×4096, took 0.55–0.99 of the time of 64 columns 1024
#: deep (1.0 for 512×512), and the weight gradients 0.64–0.95; a b of 64 columns or fewer (the
#: forward's xᵀ) is read as before
TILED_COLUMNS = 256
#: the input's gradient dy·w may be computed as dxᵀ = wᵀ·dyᵀ (`may_transpose_input_grad`) at or
#: below this many rows, where the tiled product of dy·w reads all of w for each few rows of dy
#: (one block of rows a thread), and is where this machine runs it faster (`_raced_input_grad`).
#: Measured on 2 cores (`bench/linear_blocks.py --setting transposed`, 1 and 2 threads): on an
#: AMD EPYC VM, at 32 and 64 rows 0.71–0.92 of the time with w 2048×2048, 0.61–0.89 with the
#: seed classifier's, 0.83–1.10 with w 1024 × 4096 inputs; at 128 rows 0.94–1.01. On an Intel
#: Xeon VM (2 MiB L2), with the operands placed as the runtime places them, 1.01–1.65× the time
#: on one thread and 0.98–1.33× on two at those shapes (wᵀ read down its columns: a row of w,
#: 8 KiB, apart a step)
INPUT_GRAD_TRANSPOSED_ROWS = 64
#: ... with weights of at least these bytes: a 512×512 layer's, in cache, took 1.0–1.4× the time
TRANSPOSED_WEIGHT_BYTES = 4 << 20
#: per shape of an input gradient that may run transposed (its dtype, rows, outputs, inputs
#: and the threads it runs on), whether it does: raced by its first call in this process
_INPUT_GRAD_ORDERS: dict[tuple, bool] = {}
#: the stepped product's slice of the reduction (`STEP_BLOCK_BYTES`)
TILED_DEPTH = 1024
#: at least this many blocks of c per thread where it has the rows for them, for threads to
#: share. Each row block reads all of b, so no more than the threads need: dy·w at 16 and 32
#: rows (w 2048×2048, one thread, a pipeline stage's rank) took 0.60–0.75 of its time with 16
#: blocks, the count before it was per thread (`bench/linear_blocks.py`)
TILED_TASKS_PER_THREAD = 8


@threaded
def _tiled_product(kernels, m, n, k, a, a_rs, a_cs, b, accumulate, c, depth, columns, rows):
    """c (m×n) (+)= A·b on `microkernel.tiled_gemm`, for C-contiguous b (k×n) and c, A (m×k)
    read through the strides (a_rs, a_cs): a block of `rows` × `columns` of c per task (each
    element summed by one thread, in one order whatever the thread count), its reduction in
    slices of `depth`."""
    column_blocks = (n + columns - 1) // columns
    for block in prange(((m + rows - 1) // rows) * column_blocks):
        i0, j0 = (block // column_blocks) * rows, (block % column_blocks) * columns
        height, width = min(rows, m - i0), min(columns, n - j0)
        for k0 in range(0, k, depth):
            tiled_gemm(kernels, height, width, min(depth, k - k0), a, i0 * a_rs + k0 * a_cs,
                       a_rs, a_cs, b, k0 * n + j0, n, accumulate or k0 > 0, c,
                       i0 * n + j0, n)  # fmt: skip


@threaded
def _packed_product(kernels, m, n, k, a, a_rs, a_cs, b, accumulate, c, depth, columns, rows,
                    packed):  # fmt: skip
    """`_tiled_product`, each slice of b's block copied into the thread's row of `packed`
    (`_packs`), `columns + PACKED_PAD` elements a row, and read from there: the same
    products in the same order, so the same bits. A kernel of its own, so that a run whose
    b never needs it does not compile it."""
    column_blocks = (n + columns - 1) // columns
    ld = columns + PACKED_PAD
    for block in prange(((m + rows - 1) // rows) * column_blocks):
        i0, j0 = (block // column_blocks) * rows, (block % column_blocks) * columns
        height, width = min(rows, m - i0), min(columns, n - j0)
        mine = packed[numba.get_thread_id()]
        for k0 in range(0, k, depth):
            slice_depth = min(depth, k - k0)
            for row in range(slice_depth):
                copy_run(b, (k0 + row) * n + j0, mine, row * ld, width)
            tiled_gemm(kernels, height, width, slice_depth, a, i0 * a_rs + k0 * a_cs, a_rs,
                       a_cs, mine, 0, ld, accumulate or k0 > 0, c, i0 * n + j0,
                       n)  # fmt: skip


#: b's rows are copied into a block of their own (`_packed_product`) where they lie a multiple
#: of this many bytes apart and b is at least `PACKED_LEAST_BYTES`. Rows of b 8 KiB apart (a
#: 2048-wide weight read by the input's gradient) fall into the same few sets of the core's
#: caches: the block of b that should stay in L2 while the tiles pass it (256 rows of 1 KiB)
#: has 16 of L2's 128 KiB ways' worth of sets to itself, no more than its own size, and the
#: microkernel's part of it, which should stay in L1, has 4 sets. Measured on an Intel Xeon VM
#: (48 KiB 12-way L1, 2 MiB 16-way L2; `bench/linear_blocks.py --setting packed`), dy·w packed
#: against read in place: w 2048 × 2048 (rows 8 KiB apart) at 16 to 256 rows 0.65–0.90 of the
#: time on one thread, 0.70 and 0.94 at 128 and 32 rows on two; w 1024 × 4096 (16 KiB) 0.46–0.83
#: and 0.46–0.71; w 4096 × 1024 (4 KiB, its block in L2's sets) 0.91–1.14 and 1.17–1.36 (each
#: block is copied for as few as 32 rows of c there), so not packed; w 512 × 512, in L2 whole,
#: 1.13–2.2. The weight gradient that steps Adam (`_stepped_product`) reads all of b from a
#: copy whose rows are `PACKED_PAD` longer: x of 256 and 512 rows by 4096 inputs 0.66–0.69 of
#: the time on one thread and 0.72 on two; 2048 inputs 0.65–1.04
PACKED_STRIDE_BYTES = 8192
PACKED_LEAST_BYTES = 4 << 20
#: the packed block's rows are this many elements longer than the block: one cache line (for
#: float32), so that its rows start in different sets
PACKED_PAD = 16


def _packs(b: np.ndarray) -> bool:
    """Whether the tiled product reads b through packed copies of its blocks
    (`_packed_product`): its rows a multiple of `PACKED_STRIDE_BYTES` apart, and it at least
    `PACKED_LEAST_BYTES`."""
    stride = b.shape[1] * b.itemsize
    return stride % PACKED_STRIDE_BYTES == 0 and b.nbytes >= PACKED_LEAST_BYTES


@threaded
def _stepped_product(kernels, m, n, k, a, a_rs, a_cs, b, ldb, depth, columns, rows, rule, co,
                     p, s1, s2, scratch):  # fmt: skip
    """`_tiled_product`'s A·b as the gradient of the parameter p (m×n, with its state s1,
    s2), which the optimizer's `rule` steps: each block is computed as many rows at a time as
    fill the thread's row of `scratch`, and stepped from there; the product is not stored. A
    kernel of its own, so that a run compiles only the one it calls. b's rows are `ldb`
    elements apart."""
    column_blocks = (n + columns - 1) // columns
    ld = p.strides[0] // p.itemsize
    for block in prange(((m + rows - 1) // rows) * column_blocks):
        i0, j0 = (block // column_blocks) * rows, (block % column_blocks) * columns
        height, width = min(rows, m - i0), min(columns, n - j0)
        at = numba.get_thread_id() * scratch.shape[1]
        strip_rows = scratch.shape[1] // width
        for top in range(i0, i0 + height, strip_rows):
            strip = min(strip_rows, i0 + height - top)
            for k0 in range(0, k, depth):
                tiled_gemm(kernels, strip, width, min(depth, k - k0), a, top * a_rs + k0 * a_cs,
                           a_rs, a_cs, b, k0 * ldb + j0, ldb, k0 > 0, scratch, at,
                           width)  # fmt: skip
            for row in range(strip):
                g_at, p_at = at + row * width, (top + row) * ld + j0
                step_elements(rule, co, run_view(scratch, g_at, width), run_view(p, p_at, width),
                              run_view(s1, p_at, width), run_view(s2, p_at, width))  # fmt: skip


#: with a step: the bytes of b's block of columns, wider than the product's so that each row
#: of the parameter and its state is stepped in longer runs, and the rows of a block computed
#: at once before their step (a strip of STEP_ROWS × columns stays in cache). At the seed
#: classifier's shape (batch 64, 3034 × 46656 float32 weights, Adam) the fused gradient and
#: step took 171 ms with the product's 256 KiB and 32 rows, 139 ms with 2 MiB and 16, against
#: 176 ms for the gradient and then the update
STEP_BLOCK_BYTES = 2 << 20
STEP_ROWS = 16


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """y (N, M, 1, 1) = x·wᵀ (+ b) for x (N, C, H, W), w (M, C, H, W), b (1, M, 1, 1)."""
    _check(x, w)
    n, m = x.shape[0], w.shape[0]
    y = np.empty((n, m, 1, 1), x.dtype)
    if streams(n, w):
        y[:, :, 0, 0] = _streaming_forward(_matrix(x, n), _matrix(w, m), STREAMING_CHUNK)
    else:
        product(_matrix(x, n), NO_TRANS, _matrix(w, m), TRANS, y.reshape(n, m))
    if b is not None:
        _checks.floating("b", b)
        _checks.shape("b", b, (1, m, 1, 1))
        y += b.astype(x.dtype, copy=False)
    return y


def _check_dy(dy: np.ndarray, x: np.ndarray, m: int) -> None:
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, (x.shape[0], m, 1, 1))
    _checks.same_dtype("dy", dy, "x", x)


def may_transpose_input_grad(n: int, w: np.ndarray) -> bool:
    """Whether the input's gradient of n rows with the weights w may be computed transposed:
    few rows, large weights, and rows enough for two of the microkernel's vectors (16 float32
    rows on AVX-512, with a tile one vector wide, took 1.2–1.7× the time). Whether it is, is
    this machine's answer (`_raced_input_grad`)."""
    vector_rows = 2 * VECTOR_BYTES // w.itemsize
    return vector_rows <= n <= INPUT_GRAD_TRANSPOSED_ROWS and w.nbytes >= TRANSPOSED_WEIGHT_BYTES


def linear_input_grad(dy: np.ndarray, w: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """dx (N, C, H, W) = dy·w for dy (N, M, 1, 1) and w (M, C, H, W)."""
    n, m = dy.shape[0], w.shape[0]
    dx = np.empty(input_shape, w.dtype)
    flat = dx.reshape(n, math.prod(input_shape[1:]))
    a, b = _matrix(dy, n), _matrix(w, m)
    transposed = False
    if may_transpose_input_grad(n, w):
        key = (flat.dtype.str, n, m, flat.shape[1], numba.get_num_threads())
        transposed = _INPUT_GRAD_ORDERS.get(key)
        if transposed is None:
            _INPUT_GRAD_ORDERS[key] = _raced_input_grad(a, b, flat)
            return dx
    product(a, NO_TRANS, b, NO_TRANS, flat, transposed=transposed)
    return dx


def _raced_input_grad(dy: np.ndarray, w: np.ndarray, dx: np.ndarray) -> bool:
    """dx = dy·w, and whether it runs faster transposed on this machine. The two orders sum
    each element over the same products in the same order, so they give the same bits (tested)
    and the choice is one of speed alone; which is faster is the machine's (see
    `INPUT_GRAD_TRANSPOSED_ROWS`). dx is computed three times: as is, which brings the operands
    into the caches, then in each order once, timed alike with the operands where the first
    run left them."""

    def seconds(transposed: bool) -> float:
        start = time.perf_counter()
        product(dy, NO_TRANS, w, NO_TRANS, dx, transposed=transposed)
        return time.perf_counter() - start

    seconds(False)
    return seconds(True) < seconds(False)


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
    product(_matrix(dy, n), TRANS, _matrix(x, n), NO_TRANS, dw.reshape(m, math.prod(w.shape[1:])))
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
    _checks.c_contiguous("dw", dw, " to accumulate in place")
    product(
        _matrix(dy, n),
        TRANS,
        _matrix(x, n),
        NO_TRANS,
        dw.reshape(m, math.prod(dw.shape[1:])),
        accumulate=accumulate,
    )


def linear_weight_grad_step(dy: np.ndarray, x: np.ndarray, step: OptimizerStep) -> None:
    """The step of the weights (M, C, H, W) that `step` holds by their gradient dyᵀ·x, which
    is not kept: each block of it steps the weights while it is in cache (`_tiled_product`).
    Weights that are not C-contiguous, or whose state does not share their strides, take
    the gradient whole and then the step."""
    weights = step.params
    _checks.floating("dy", dy, 4)
    _check(x, weights)
    n, m = x.shape[0], weights.shape[0]
    _check_dy(dy, x, m)
    features = math.prod(weights.shape[1:])
    if not (step.shares_strides() and all(o.flags.c_contiguous for o in step.operands)):
        dw = np.empty(weights.shape, weights.dtype)
        linear_weight_grad_accumulate(dy, x, dw, accumulate=False)
        step.apply(dw)
        return
    if m == 0 or features == 0:
        return
    if n == 0:
        step.apply(np.zeros_like(weights))
        return
    # the weights stand in for the product's c, which a step does not write
    _tiled(_matrix(dy, n), TRANS, _matrix(x, n), weights.reshape(m, features), False, step)
