"""A register-tiled GEMM for the filter kernels, compiled for the host.

The filter passes are thousands of small products per call (64×448×64 per output position and
window row at the seed's L1 shape). Through BLAS each one pays a packing of both operands, and
OpenBLAS's kernels are the ones its core type selects, which an environment may pin below the
machine (`OPENBLAS_CORETYPE=Haswell` runs AVX2 kernels on an AVX-512 CPU). This module
runs the product on tiles of C it emits itself instead (`gemm_tile`: LLVM vector code as wide
as the host's registers), in an order chosen by the result's size (`_columns_outermost`), over
panels of the reduction that stay in the core's L2 (`_gemm`), as one C-callable function per
element type (`kernels`) that the kernels call through its address (`tiled_gemm` and its
variants).

With it, `legion-nn bench kernels` on a 2-core Zen 5 (AVX-512) ran the seed's L1 untied passes
at 390–462 GFLOP/s in float32 (76–90% of OpenBLAS's own 2048² SGEMM with its AVX-512 kernels),
against 174–235 when the same loops called single-threaded OpenBLAS per product with the
environment's Haswell kernels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core.caching import FunctionCache
from numba.extending import intrinsic

from runtime.aligned import LINE
from runtime.kernels.gemm_tile import MAX_ROWS, MAX_VECTORS, VECTOR_BYTES, tile_product, tile_rows
from runtime.kernels.llvm_memory import element_pointer, is_single, prefetch_rows, store_fence
from runtime.kernels.threaded import inner

#: `tiled_gemm`'s `accumulate` beyond False and True (C = A·B, C += A·B): C = A·B with C's
#: whole vectors stored non-temporally, past the caches, where C is vector-aligned (else as
#: False). For a product whose result is a stream far larger than the caches and not read
#: again soon (the untied weight gradient: 585 MB a call at the seed's L1 shape): a store that
#: misses first reads the line it writes, doubling the traffic, and the tiles wait on it.
WRITE, ACCUMULATE, STREAM = 0, 1, 2


def _gemm(itself, m, n, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, next_off, next_rows,
          next_ld, next_columns, blocks, a_block, b_block):  # fmt: skip
    """The body of the compiled GEMM (see `tiled_gemm_prefetching` and `tiled_gemm_sum`), on
    typed pointers to the first element of each operand; `next_off` is relative to `a`.

    Its reduction runs in panels of depth (`_panels`) whose rows of B fit in `PANEL_BYTES`:
    where there are several, the GEMM calls itself once a panel through its own address
    (`itself`; 0 in those calls), each call every tile of C over its panel (in the order
    `_columns_outermost` chooses): the panel's rows of B, shared by every row tile, stay in
    the core's L2. Later panels add to C;
    a streamed result is one panel. The caller's next operand is hinted a share a panel; where
    it names none and A's rows are unit-stride, each panel hints the next panel's rows of A:
    the untied forward streams its weights from memory once, and at batch 64 ran 2-4 points of
    SGEMM faster with them. (A loop over panels around the tiles had LLVM copy their 20 bodies,
    1.6-2.9 s of compiling against 1.1, and run the one-panel weight gradients 3-5% slower;
    called through the address, the loop adds some 0.45 s to the GEMM's compile.)"""
    itemsize = 4 if is_single(a) else 8
    if itself != 0:
        per_block, steps, panels = _panels(n * itemsize, k, blocks, accumulate == STREAM)
        columns = _block_columns(m, n, _rows_read(per_block, steps, k, blocks), itemsize)
        calls = panels * -(-n // columns)
        if calls > 1:
            ahead = next_rows == 0 and a_cs == 1
            for call in range(calls):
                j0, panel = call // panels * columns, call % panels
                count, depth, a_at, b_at = _panel(panel, per_block, steps, k, blocks, a_cs, ldb,
                                                  a_block, b_block)  # fmt: skip
                hint_at, hint_rows, hint_ld, hint_columns = 0, 0, 0, 0
                if next_rows > 0:
                    lo, hi = next_rows * call // calls, next_rows * (call + 1) // calls
                    hint_at, hint_rows = next_off + lo * next_ld, hi - lo
                    hint_ld, hint_columns = next_ld, next_columns
                elif ahead and panel + 1 < panels:
                    _, hint_columns, hint_at, _ = _panel(panel + 1, per_block, steps, k, blocks,
                                                         a_cs, ldb, a_block, b_block)  # fmt: skip
                    hint_rows, hint_ld = m, a_rs
                _call(itself, 0, m, min(columns, n - j0), depth, a, a_at, a_rs, a_cs, b,
                      b_at + j0, ldb, accumulate if panel == 0 else ACCUMULATE, c, j0, ldc,
                      hint_at - a_at, hint_rows, hint_ld, hint_columns, count, a_block,
                      b_block)  # fmt: skip
            return
    width = VECTOR_BYTES // itemsize
    block = MAX_VECTORS * width
    tiles = -(-m // MAX_ROWS) * -(-n // block)
    tile = 0
    add = accumulate == ACCUMULATE
    stream = accumulate == STREAM and _vector_aligned(c, ldc)
    down = int(_columns_outermost(m, n, block, stream, itemsize))
    # one loop over the tiles, either order, so that the tile bodies are emitted once
    i0, n0 = 0, 0
    while True:
        rows = tile_rows(m - i0)
        left = n - n0
        vectors, tail = (min(MAX_VECTORS, left // width), width) if left >= width else (1, left)
        hint_at, hint_lines = 0, 0
        if next_rows > 0 and tile < tiles:
            lo, hi = next_rows * tile // tiles, next_rows * (tile + 1) // tiles
            if next_ld == next_columns or hi - lo == 1:  # one run: hinted over the tile's steps
                hint_at = next_off + lo * next_ld
                hint_lines = -(-(hi - lo) * next_columns * itemsize // LINE) + 1
            else:
                prefetch_rows(a, next_off + lo * next_ld, hi - lo, next_ld, next_columns)
            tile += 1
        tile_product(rows, vectors, tail, c, i0 * ldc + n0, ldc, a, i0 * a_rs, a_rs, a_cs, b,
                     n0, ldb, k, add, stream, blocks, a_block, b_block, hint_at,
                     hint_lines)  # fmt: skip
        columns = vectors * width if tail == width else tail
        # the next tile, in arithmetic rather than a branch on the order: LLVM would copy the
        # loop, and with it every tile body, once for each order
        i1, n1 = i0 + rows * down, n0 + columns * (1 - down)
        if (i1 < m) * down + (n1 < n) * (1 - down):
            i0, n0 = i1, n1
            continue
        i0, n0 = (i0 + rows) * (1 - down), (n0 + columns) * down
        if i0 >= m or n0 >= n:
            break
    if stream:
        store_fence()


@intrinsic
def _vector_aligned(typingctx, pointer, ld):
    """Whether every row of C, `ld` elements apart from `pointer` on, starts on a vector:
    non-temporal stores of whole vectors need it."""

    def codegen(context, builder, signature, args):
        pointer_, ld_ = args
        index = ld_.type
        size = ir.Constant(index, signature.args[0].dtype.bitwidth // 8)
        vector = ir.Constant(index, VECTOR_BYTES)
        zero = ir.Constant(index, 0)
        address = builder.ptrtoint(pointer_, index)
        starts = builder.icmp_unsigned("==", builder.urem(address, vector), zero)
        rows = builder.icmp_unsigned("==", builder.urem(builder.mul(ld_, size), vector), zero)
        return builder.and_(starts, rows)

    if not isinstance(pointer, types.CPointer):
        return None
    return types.boolean(pointer, types.intp), codegen


#: the bytes of B's rows one panel of the reduction reads (`_gemm`): within the L2 of every
#: core of this kind (256 KiB on the smallest), beside C's tiles and A's rows. Reading all of B
#: once per row tile had it stream from L3 wherever it outgrew L2: the seed's L1 forward at
#: batch 256 (B 3.2 MB a position) ran at 59-67% of SGEMM on a core of 512 KiB L2
PANEL_BYTES = 128 * 1024
#: the least depth of a panel: C's tiles, loaded and stored once a panel, cost a step of the
#: reduction each (the tied weight gradient at batch 256, depth 256 in panels of 64, ran at 76%
#: of SGEMM in one run against 83% in one panel)
PANEL_LEAST_DEPTH = 256


@njit(cache=True, nogil=True, inline="always")
def _panel(panel, per_block, steps, k, blocks, a_cs, ldb, a_block, b_block):
    """Panel `panel` of `_panels`' cut: (blocks, depth, offset into A, offset into B)."""
    if per_block > 0:  # whole blocks: `per_block` of them, each of depth k
        j0 = panel * per_block
        return min(per_block, blocks - j0), k, j0 * a_block, j0 * b_block
    j, part = panel // steps, panel % steps  # a part of one block's depth
    l0, l1 = k * part // steps, k * (part + 1) // steps
    count = 1 if j < blocks else 0
    return count, l1 - l0, j * a_block + l0 * a_cs, j * b_block + l0 * ldb


@njit(cache=True, nogil=True, inline="always")
def _panels(row_bytes, k, blocks, whole):
    """How `_gemm` cuts a reduction of `blocks` blocks of depth `k`, over rows of B of
    `row_bytes`, into panels: (blocks a panel, 0, panels) where whole blocks fit, else (0,
    parts of a block, panels). Never fewer than one panel, so that a product of depth 0 still
    writes its zeros; one where `whole` (a result streamed past the caches, which a second
    panel would read back)."""
    if whole:
        return max(blocks, 1), 1, 1
    fit = max(PANEL_LEAST_DEPTH, PANEL_BYTES // max(row_bytes, 1))
    if k <= fit:
        per_block = max(1, fit // max(k, 1))
        return per_block, 1, max(1, -(-blocks // per_block))
    steps = -(-k // fit)
    return 0, steps, max(1, blocks * steps)


@njit(cache=True, nogil=True, inline="always")
def _rows_read(per_block, steps, k, blocks):
    """The most rows of B one panel of `_panels`' cut reads: its whole blocks' (no more than
    there are), else its part of one block's depth."""
    return min(per_block, max(blocks, 1)) * k if per_block > 0 else -(-k // steps)


#: a panel's rows of B beyond these bytes are swept in blocks of columns (`_block_columns`):
#: the L2 of the larger cores of this kind. A panel of B at its least depth that fits a core's
#: L2 (256 KiB: the seed's L1 forward at batch 256) was read faster whole: cut into blocks of
#: `PANEL_BYTES`, that forward ran at 0.88 of its speed on a 512 KiB L2
COLUMN_BLOCKS_BEYOND = 1 << 20


@njit(cache=True, nogil=True, inline="always")
def _block_columns(m, n, rows_read, itemsize):
    """The columns of C `_gemm` sweeps at a time: all n, unless a panel's rows of B
    (`rows_read` of them, n wide) outgrow `COLUMN_BLOCKS_BEYOND`, where a panel cannot cut them
    (at its least depth, or a streamed result whole), while A's rows for the panel fit in
    `PANEL_BYTES`: then as many columns, in whole blocks of a tile's vectors, as keep B's block
    within `PANEL_BYTES`, so that every row tile reads it from L2 rather than from L3 or
    memory, and A, read again once a block of columns, is read from L2. One row tile reads B
    once: it sweeps all n. The weight gradient that steps its weights as it goes (16 rows of
    the seed classifier's 3034 × 46656, depth 64: B 2 MiB) took 0.83-0.88 of its time so on
    a 512 KiB L2."""
    b_bytes = rows_read * n * itemsize
    if m <= MAX_ROWS or b_bytes <= COLUMN_BLOCKS_BEYOND or m * rows_read * itemsize > PANEL_BYTES:
        return max(n, 1)
    block = MAX_VECTORS * (VECTOR_BYTES // itemsize)
    return max(block, PANEL_BYTES // (rows_read * itemsize) // block * block)


#: results of at most these bytes are computed a block of a tile's columns at a time, every row
#: tile down it in turn; larger ones a row tile at a time, across every block of columns (see
#: `_columns_outermost`). A 512 KiB L2 holds one
COLUMNS_OUTERMOST_MOST_BYTES = 512 << 10


@njit(cache=True, nogil=True, inline="always")
def _columns_outermost(m, n, block, stream, itemsize):
    """Whether `_gemm` sweeps C's tiles down each block of `block` columns in turn (B's block,
    a tile's width, stays in L1 while every row tile passes it; A is read again once a block,
    from L2) rather than across each row tile (A's rows stay in L1 while B's panel, all its
    columns, is read again for each row tile, from L2 at best). Down the columns reads about a
    tenth of the bytes from L2, but writes C in runs of one tile's width: a result larger than
    `COLUMNS_OUTERMOST_MOST_BYTES` and not streamed, stored from beyond the caches, then waits
    on a read of each line it writes, which row tiles' long runs let the prefetchers hide. On
    a 2-core Intel Xeon (AVX-512, 2 MiB L2), alternated with row tiles outermost, the seed's
    L1 passes ran 2-6% nearer the SGEMM beside them (tied weight gradient at batch 256 0.79 ->
    0.81-0.82; untied input gradient 0.78 -> 0.80-0.85), and the seed classifier's weight
    gradient (3034 rows of 256 columns a call, 3.1 MB) took 1.4x its time."""
    return n > block and (stream or m * n * itemsize <= COLUMNS_OUTERMOST_MOST_BYTES)


def _signature(dtype):
    pointer = types.CPointer(dtype)
    i = types.intp
    return types.void(i, i, i, i, pointer, i, i, pointer, i, i, pointer, i, i, i, i, i, i, i, i)


#: the compiled GEMM's address per element size, 0 until `kernels` compiles it
_ADDRESSES = np.zeros(2, np.intp)
_COMPILED: dict[int, object] = {}


def kernels(dtype) -> np.ndarray:
    """The table of compiled GEMMs that `tiled_gemm` takes, with the one for `dtype` in it.

    The GEMM is one C-callable function per element type, compiled (or loaded from Numba's
    cache) the first time a run asks for that type, and called through its address. Inlined
    into each filter kernel, as it was, its unrolled tile bodies (30 then) were optimised by
    LLVM once per caller and per array layout, which made most of a cold start's 30 s of
    compiling."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"tiled_gemm: float32 or float64, got {dtype}")
    slot = _slot(dtype.itemsize)
    if slot not in _COMPILED:
        with _compiled_once(dtype):
            compiled = cfunc(_signature(numba.from_dtype(dtype)), cache=True)(_gemm)
        _COMPILED[slot] = compiled
        _ADDRESSES[slot] = compiled.address
    return _ADDRESSES


#: how long a process waits for another process's compiling of the GEMM before it compiles the
#: GEMM itself (the other has hung; one that dies releases its lock at once)
GEMM_LOCK_WAIT_S = 120.0


@contextmanager
def _compiled_once(dtype: np.dtype) -> Iterator[None]:
    """Held while this process compiles the GEMM for `dtype`, or loads it from Numba's cache: a
    lock on a file beside that cache, so that the processes of a host compile it once (the ranks
    under `mpiexec`, a run and its helpers: `runtime.compile_ahead`) and the others load what
    the first wrote. A helper that reached its GEMM callers a tenth of a second before the run
    had written the GEMM compiled it again, 1.4 s of the default job's cold start. The file
    stays with the cache, as the cache's own files do. Without a lock to take (a platform
    without `flock`, a cache it cannot write, a file system without locks) each compiles its
    own."""
    try:
        import fcntl

        folder = Path(FunctionCache(_gemm)._cache_path)
        handle = os.open(folder / f"microkernel._gemm.{dtype.name}.lock", os.O_RDWR | os.O_CREAT)
    except (ImportError, OSError, AttributeError, RuntimeError):
        yield
        return
    try:
        deadline = time.monotonic() + GEMM_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            except OSError:  # a file system without locks (some shared ones): compile here
                break
        yield
    finally:
        os.close(handle)  # and with it the lock


def _slot(itemsize: int) -> int:
    return 0 if itemsize == 4 else 1


@intrinsic
def _call(typingctx, address, lead, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate,
          c, c_off, ldc, next_off, next_rows, next_ld, next_columns, blocks, a_block,
          b_block):  # fmt: skip
    """Call the compiled GEMM at `address` on pointers into a, b and c, with `lead` its first
    argument (`_gemm`'s `itself`)."""
    if not (c.dtype == a.dtype == b.dtype and c.dtype in (types.float32, types.float64)):
        return None
    if not isinstance(accumulate, (types.Boolean, types.Integer)):
        return None
    i = types.intp
    sig = types.void(i, i, i, i, i, a, i, i, i, b, i, i, accumulate, c, i, i, i, i, i, i, i, i, i)

    def codegen(context, builder, signature, args):
        (address_, lead_, m_, n_, k_, a_, a_off_, a_rs_, a_cs_, b_, b_off_, ldb_, acc_, c_,
         c_off_, ldc_, next_off_, next_rows_, next_ld_, next_columns_, blocks_, a_block_,
         b_block_) = args  # fmt: skip
        operand_types = signature.args
        a_ptr = element_pointer(context, builder, operand_types[5], a_, a_off_)
        b_ptr = element_pointer(context, builder, operand_types[9], b_, b_off_)
        c_ptr = element_pointer(context, builder, operand_types[13], c_, c_off_)
        index = m_.type
        pointer = a_ptr.type
        function_type = ir.FunctionType(
            ir.VoidType(),
            [index, index, index, index, pointer, index, index, pointer, index, index, pointer,
             index, index, index, index, index, index, index, index],
        )  # fmt: skip
        target = builder.inttoptr(address_, function_type.as_pointer())
        builder.call(
            target,
            [lead_, m_, n_, k_, a_ptr, a_rs_, a_cs_, b_ptr, ldb_,
             context.cast(builder, acc_, operand_types[12], types.intp), c_ptr, ldc_,
             next_off_, next_rows_, next_ld_, next_columns_, blocks_, a_block_, b_block_],
        )  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def tiled_gemm(kernels, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate, c, c_off, ldc):
    """C[c_off:] (m×n, row stride ldc) = A·B (+ C if `accumulate`), offsets and strides in
    elements: A (m×k) has element (i, l) at a_off + i·a_rs + l·a_cs, B (k×n) is row-major with
    unit-stride rows. With k = 0 it writes zeros (or leaves C as it is). `kernels` is
    `kernels(dtype)` for the operands' dtype.

    The wrappers are inlined into their callers: compiled apart, each was compiled once per
    caller's operand types (0.1–0.2 s each on an empty cache, four of them in the default job).
    Nothing in them may leave a caller's `prange` body but through its end (`_address` raises
    in a call of its own)."""
    if m > 0 and n > 0:
        gemm = _address(kernels, a.itemsize)
        _call(gemm, gemm, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate, c, c_off,
              ldc, 0, 0, 0, 0, 1, 0, 0)  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def tiled_gemm_prefetching(
    kernels, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate, c, c_off, ldc,
    next_off, next_rows, next_ld, next_columns,
):  # fmt: skip
    """`tiled_gemm`, which also prefetches the next product's A operand, a[next_off:] as
    `next_rows` rows of `next_columns` elements `next_ld` apart, a slice before each tile.

    The filter passes stream each weight block from memory once. Read in a product's own
    order they arrive late: backward-data reads a block down its columns (64 rows at a time,
    one cache line each), which the hardware prefetchers do not follow, and it ran at 65–70%
    of SGEMM against 90% with the block hinted in ahead, spread over the tiles so that the
    hints do not overflow the core's queue of outstanding misses. Where a tile's share of the
    hints is one run of memory, the tile sends them out over its own steps (`gemm_tile`, one
    every 2**s steps): sent before it, on a 2-core Intel Xeon VM, 163 hints of memory lines a
    tile held the core's fill buffers while the tile's loads waited, and the seed's L1 untied
    forward and input gradient at batch 64 ran at 0.67-0.79 of the SGEMM beside them, against
    0.83-0.89 spread (alternated, medians of seven; batch 256 and the tied passes, which hint
    little, unchanged)."""
    if m > 0 and n > 0:
        gemm = _address(kernels, a.itemsize)
        _call(gemm, gemm, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate, c, c_off,
              ldc, next_off - a_off, next_rows, next_ld, next_columns, 1, 0, 0)  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def tiled_gemm_sum(kernels, m, n, k, blocks, a, a_off, a_rs, a_cs, a_block, b, b_off, ldb,
                   b_block, accumulate, c, c_off, ldc):  # fmt: skip
    """C[c_off:] = Σ_j A_j·B_j (+ C if `accumulate`) over j < `blocks`, where A_j and B_j are
    `tiled_gemm`'s A and B moved on by j·a_block and j·b_block elements: one product of depth
    blocks·k whose tiles stay in registers throughout. A filter's forward sums its window rows
    so, which with the seed's one-channel first layer (k = 9) stores each tile once instead of
    nine times."""
    if m > 0 and n > 0:
        gemm = _address(kernels, a.itemsize)
        _call(gemm, gemm, m, n, k, a, a_off, a_rs, a_cs, b, b_off, ldb, accumulate, c, c_off,
              ldc, 0, 0, 0, 0, blocks, a_block, b_block)  # fmt: skip


@inner
def _address(kernels, itemsize):
    """The GEMM's address for elements of `itemsize` bytes. Not inlined into the wrappers, which
    are: a raise inside a caller's `prange` body would keep its loop from running in
    parallel, and its one signature is compiled once for every caller."""
    address = kernels[0 if itemsize == 4 else 1]
    if address == 0:
        raise ValueError("tiled_gemm: no GEMM compiled for this dtype; pass kernels(dtype)")
    return address
