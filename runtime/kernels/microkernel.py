"""A register-tiled GEMM for the filter kernels, emitted as LLVM vector code for the host.

The filter passes are thousands of small products per call (64×448×64 per output position and
window row at the seed's L1 shape). Through BLAS each one pays a packing of both operands, and
OpenBLAS's kernels are the ones its core type selects, which an environment may pin below the
machine (`OPENBLAS_CORETYPE=Haswell` runs AVX2 kernels on an AVX-512 CPU). This module
generates the inner kernel itself instead:

    C[i, 0:w] (+)= Σ_l A[i·a_rs + l·a_cs] · B[l·ldb + 0:w]        for i < mr, l < depth

with mr rows of C held as `nv` vectors each in registers for the whole reduction, one vector
load of B's row per vector and one broadcast of A's element per row at each step. B and C
rows are read in place through their leading dimensions, and A through any two strides, so
the forward (A = the weights), backward-data (A = the weights transposed) and backward-filter
(A = the output gradient) passes all run on the packed tensors without a copy of A.

The body is written as LLVM IR with vectors as wide as the host's registers (`VECTOR_BYTES`:
AVX-512, AVX2 or 128-bit) and `llvm.fmuladd` (one FMA where the host has them), inside a Numba intrinsic, so it is compiled for the
host ISA by Numba's own LLVM and cached like any other Numba function. The tile shapes are
chosen so the accumulators, B's vectors and a broadcast fit in the vector register file
(`MAX_ROWS` × `MAX_VECTORS` accumulators: 24 of AVX-512's 32 registers, 12 of AVX2's 16). A
row narrower than a vector ends in one masked tile (`llvm.masked.load` / `.store`), so every
width is handled here and nothing falls back to BLAS.

With it, `legion-nn bench kernels` on a 2-core Zen 5 (AVX-512) ran the seed's L1 untied passes
at 390–462 GFLOP/s in float32 (76–90% of OpenBLAS's own 2048² SGEMM with its AVX-512 kernels),
against 174–235 when the same loops called single-threaded OpenBLAS per product with the
environment's Haswell kernels.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from runtime.kernels.llvm_memory import element_pointer, is_single, prefetch_rows, store_fence
from runtime.kernels.threaded import inner


def _target_vector_bytes() -> int:
    """The vector width of the CPU Numba compiles for: the host's, unless `NUMBA_CPU_NAME` /
    `NUMBA_CPU_FEATURES` name another target (portable caches), whose features then decide, or
    128 bits when only a name is given."""
    if numba.config.CPU_FEATURES:
        features = numba.config.CPU_FEATURES
    elif numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        return 16
    else:
        features = llvm_binding.get_host_cpu_features().flatten()
    if "+avx512f" in features:
        return 64
    if "+avx" in features:
        return 32
    return 16


VECTOR_BYTES = _target_vector_bytes()
#: rows of C in one tile, and the most vectors per row: 24 accumulators with AVX-512's 32
#: registers, 12 with the 16 of AVX2 or SSE, leaving room for B's vectors and a broadcast
MAX_ROWS = 6
MAX_VECTORS = 4 if VECTOR_BYTES == 64 else 2
#: the row counts a tile body is unrolled for: a last row tile of 5 or 3 rows runs as 4 + 1 or
#: 2 + 1, so that the GEMM has 4 row counts' bodies to compile rather than 6 (each of its
#: bodies is some 40 ms of a cold start's compiling)
TILE_ROWS = (6, 4, 2, 1)


@njit(cache=True, nogil=True, inline="always")
def _tile_rows(left):
    """The rows of the next row tile with `left` rows of C to go: the most of `TILE_ROWS`."""
    for rows in TILE_ROWS:
        if left >= rows:
            return rows
    return 1


def lanes(itemsize: int) -> int:
    """Elements of one vector."""
    return VECTOR_BYTES // itemsize


_I32 = ir.IntType(32)

#: `tiled_gemm`'s `accumulate` beyond False and True (C = A·B, C += A·B): C = A·B with C's
#: whole vectors stored non-temporally, past the caches, where C is vector-aligned (else as
#: False). For a product whose result is a stream far larger than the caches and not read
#: again soon (the untied weight gradient: 585 MB a call at the seed's L1 shape): a store that
#: misses first reads the line it writes, doubling the traffic, and the tiles wait on it.
WRITE, ACCUMULATE, STREAM = 0, 1, 2


def _tile_body(builder, vty, rows, vectors, c, ldc, a, a_rs, a_cs, b, ldb, depth, accumulate,
               stream, blocks, a_block, b_block, tail):  # fmt: skip
    """One tile: C (rows × vectors, the last vector's first `tail` lanes when `tail` is an IR
    value) (+)= A · B over `depth` steps, accumulators in SSA registers (allocas that LLVM's
    mem2reg promotes); where `stream` (an IR boolean) holds, C's whole vectors are stored
    non-temporally (`STREAM`)."""
    width = vty.count
    size = 4 if vty.element == ir.FloatType() else 8
    vptr = vty.as_pointer()
    index = ldc.type
    module = builder.module
    suffix = f"v{width}f{size * 8}"
    fma = cgutils.get_or_insert_function(
        module, ir.FunctionType(vty, [vty] * 3), f"llvm.fmuladd.{suffix}"
    )
    mask = None
    if tail is not None:
        mask_ty = ir.VectorType(ir.IntType(1), width)
        lane_ids = ir.Constant(ir.VectorType(_I32, width), list(range(width)))
        splat = builder.insert_element(
            ir.Constant(ir.VectorType(_I32, width), ir.Undefined),
            builder.trunc(tail, _I32),
            ir.Constant(_I32, 0),
        )
        splat = builder.shuffle_vector(
            splat, splat, ir.Constant(ir.VectorType(_I32, width), [0] * width)
        )
        mask = builder.icmp_signed("<", lane_ids, splat)
        masked_load = cgutils.get_or_insert_function(
            module,
            ir.FunctionType(vty, [vptr, _I32, mask_ty, vty]),
            f"llvm.masked.load.{suffix}.p0",
        )
        masked_store = cgutils.get_or_insert_function(
            module,
            ir.FunctionType(ir.VoidType(), [vty, vptr, _I32, mask_ty]),
            f"llvm.masked.store.{suffix}.p0",
        )
    zero = ir.Constant(vty, None)
    align = ir.Constant(_I32, size)

    def vector_at(row_ptr, v):
        return builder.bitcast(builder.gep(row_ptr, [ir.Constant(index, v * width)]), vptr)

    def load(row_ptr, v):
        ptr = vector_at(row_ptr, v)
        if mask is not None and v == vectors - 1:
            return builder.call(masked_load, [ptr, align, mask, zero])
        return builder.load(ptr, align=size)

    def store(value, row_ptr, v):
        ptr = vector_at(row_ptr, v)
        if mask is not None and v == vectors - 1:
            builder.call(masked_store, [value, ptr, align, mask])
        else:
            builder.store(value, ptr, align=size)

    accs = [[cgutils.alloca_once(builder, vty) for _ in range(vectors)] for _ in range(rows)]
    c_rows = [builder.gep(c, [builder.mul(ir.Constant(index, i), ldc)]) for i in range(rows)]
    a_rows = [builder.gep(a, [builder.mul(ir.Constant(index, i), a_rs)]) for i in range(rows)]
    with builder.if_else(accumulate) as (then, otherwise):
        with then:
            for i in range(rows):
                for v in range(vectors):
                    builder.store(load(c_rows[i], v), accs[i][v])
        with otherwise:
            for i in range(rows):
                for v in range(vectors):
                    builder.store(zero, accs[i][v])
    broadcast = ir.Constant(ir.VectorType(_I32, width), [0] * width)
    # the products of `blocks` pairs (A, B), each `a_block` and `b_block` after the last, summed
    # in the same accumulators
    with cgutils.for_range(builder, blocks) as outer:
        b_first = builder.gep(b, [builder.mul(outer.index, b_block)])
        a_first = builder.mul(outer.index, a_block)
        with cgutils.for_range(builder, depth) as loop:
            _tile_step(builder, vty, fma, load, accs, rows, vectors, broadcast, a_rows, a_cs,
                       b_first, ldb, a_first, loop.index)  # fmt: skip
    nontemporal = module.add_metadata([ir.Constant(_I32, 1)])
    with builder.if_else(stream) as (streamed, cached):
        with streamed:
            for i in range(rows):
                for v in range(vectors):
                    value = builder.load(accs[i][v])
                    if mask is not None and v == vectors - 1:
                        store(value, c_rows[i], v)
                    else:
                        written = builder.store(value, vector_at(c_rows[i], v), align=width * size)
                        written.set_metadata("nontemporal", nontemporal)
        with cached:
            for i in range(rows):
                for v in range(vectors):
                    store(builder.load(accs[i][v]), c_rows[i], v)


def _tile_step(builder, vty, fma, load, accs, rows, vectors, broadcast, a_rows, a_cs, b, ldb,
               a_first, step):  # fmt: skip
    """One step of the reduction: B's row `step` times column `step` of A, into the tile."""
    b_row = builder.gep(b, [builder.mul(step, ldb)])
    b_vectors = [load(b_row, v) for v in range(vectors)]
    a_step = builder.add(a_first, builder.mul(step, a_cs))
    for i in range(rows):
        element = builder.load(builder.gep(a_rows[i], [a_step]))
        lane0 = builder.insert_element(
            ir.Constant(vty, ir.Undefined), element, ir.Constant(_I32, 0)
        )
        splat = builder.shuffle_vector(lane0, ir.Constant(vty, ir.Undefined), broadcast)
        for v in range(vectors):
            total = builder.call(fma, [splat, b_vectors[v], builder.load(accs[i][v])])
            builder.store(total, accs[i][v])


@intrinsic
def _tile(
    typingctx,
    rows,
    vectors,
    tail,
    c,
    c_off,
    ldc,
    a,
    a_off,
    a_rs,
    a_cs,
    b,
    b_off,
    ldb,
    depth,
    accumulate,
    stream,
    blocks,
    a_block,
    b_block,
):
    """C[c_off:] (rows × vectors·lanes, row stride ldc) (+)= Σ A · B over `blocks` pairs of
    blocks (see `tiled_gemm_sum`), dispatched on (rows,
    vectors) to a fully unrolled body; `tail` < lanes makes the (single) vector masked;
    `stream`: C's whole vectors stored non-temporally (they must be vector-aligned)."""
    if not (c.dtype == a.dtype == b.dtype and c.dtype in (types.float32, types.float64)):
        return None
    sig = types.void(
        types.intp,
        types.intp,
        types.intp,
        c,
        types.intp,
        types.intp,
        a,
        types.intp,
        types.intp,
        types.intp,
        b,
        types.intp,
        types.intp,
        types.intp,
        types.boolean,
        types.boolean,
        types.intp,
        types.intp,
        types.intp,
    )

    def codegen(context, builder, signature, args):
        (
            rows_,
            vectors_,
            tail_,
            c_,
            c_off_,
            ldc_,
            a_,
            a_off_,
            a_rs_,
            a_cs_,
            b_,
            b_off_,
            ldb_,
            depth_,
            acc_,
            stream_,
            blocks_,
            a_block_,
            b_block_,
        ) = args
        operand_types = signature.args
        c_ptr = element_pointer(context, builder, operand_types[3], c_, c_off_)
        a_ptr = element_pointer(context, builder, operand_types[6], a_, a_off_)
        b_ptr = element_pointer(context, builder, operand_types[10], b_, b_off_)
        dtype = operand_types[3].dtype
        vty = ir.VectorType(context.get_value_type(dtype), lanes(dtype.bitwidth // 8))
        function = builder.function
        done = function.append_basic_block("tile.done")
        width = ir.Constant(tail_.type, vty.count)
        masked = builder.icmp_signed("<", tail_, width)
        key = builder.add(builder.mul(rows_, ir.Constant(rows_.type, 16)), vectors_)
        key = builder.select(masked, builder.add(key, ir.Constant(key.type, 8)), key)
        switch = builder.switch(key, done)
        operands = (c_ptr, ldc_, a_ptr, a_rs_, a_cs_, b_ptr, ldb_, depth_, acc_, stream_, blocks_,
                    a_block_, b_block_)  # fmt: skip
        for r in TILE_ROWS:
            # whole vectors (1..MAX_VECTORS of them), then one masked vector (key + 8)
            variants = [(v, None, f"{r}x{v}", r * 16 + v) for v in range(1, MAX_VECTORS + 1)]
            variants.append((1, tail_, f"{r}x1.masked", r * 16 + 1 + 8))
            for count, lanes_left, name, case in variants:
                block = function.append_basic_block(f"tile.{name}")
                switch.add_case(ir.Constant(key.type, case), block)
                builder.position_at_end(block)
                _tile_body(builder, vty, r, count, *operands, lanes_left)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


def _gemm(itself, m, n, k, a, a_rs, a_cs, b, ldb, accumulate, c, ldc, next_off, next_rows,
          next_ld, next_columns, blocks, a_block, b_block):  # fmt: skip
    """The body of the compiled GEMM (see `tiled_gemm_prefetching` and `tiled_gemm_sum`), on
    typed pointers to the first element of each operand; `next_off` is relative to `a`.

    Its reduction runs in panels of depth (`_panels`) whose rows of B fit in `PANEL_BYTES`:
    where there are several, the GEMM calls itself once a panel through its own address
    (`itself`; 0 in those calls), each call every tile of C over its panel, row tiles
    outermost: a tile's rows of A (the weights, in the forward) are read once while the
    panel's rows of B, shared by every row tile, stay in the core's L2. Later panels add to C;
    a streamed result is one panel. The caller's next operand is hinted a share a panel; where
    it names none and A's rows are unit-stride, each panel hints the next panel's rows of A:
    the untied forward streams its weights from memory once, and at batch 64 ran 2-4 points of
    SGEMM faster with them. (A loop over panels around the tiles had LLVM copy their 20 bodies,
    1.6-2.9 s of compiling against 1.1, and run the one-panel weight gradients 3-5% slower;
    called through the address, the loop adds some 0.45 s to the GEMM's compile.)"""
    if itself != 0:
        itemsize = 4 if is_single(a) else 8
        per_block, steps, panels = _panels(n * itemsize, k, blocks, accumulate == STREAM)
        if panels > 1:
            ahead = next_rows == 0 and a_cs == 1
            for panel in range(panels):
                count, depth, a_at, b_at = _panel(panel, per_block, steps, k, blocks, a_cs, ldb,
                                                  a_block, b_block)  # fmt: skip
                hint_at, hint_rows, hint_ld, hint_columns = 0, 0, 0, 0
                if next_rows > 0:
                    lo, hi = next_rows * panel // panels, next_rows * (panel + 1) // panels
                    hint_at, hint_rows = next_off + lo * next_ld, hi - lo
                    hint_ld, hint_columns = next_ld, next_columns
                elif ahead and panel + 1 < panels:
                    _, hint_columns, hint_at, _ = _panel(panel + 1, per_block, steps, k, blocks,
                                                         a_cs, ldb, a_block, b_block)  # fmt: skip
                    hint_rows, hint_ld = m, a_rs
                _call(itself, 0, m, n, depth, a, a_at, a_rs, a_cs, b, b_at, ldb,
                      accumulate if panel == 0 else ACCUMULATE, c, 0, ldc, hint_at - a_at,
                      hint_rows, hint_ld, hint_columns, count, a_block, b_block)  # fmt: skip
            return
    width = VECTOR_BYTES // (4 if is_single(a) else 8)
    block = MAX_VECTORS * width
    tiles = -(-m // MAX_ROWS) * -(-n // block)
    tile = 0
    add = accumulate == ACCUMULATE
    stream = accumulate == STREAM and _vector_aligned(c, ldc)
    # row tiles outermost: a tile's A rows (the weights, in the forward) are read once, while
    # B's rows, shared by every row tile, stay in cache
    i0 = 0
    while i0 < m:
        rows = _tile_rows(m - i0)
        n0 = 0
        while n0 < n:
            left = n - n0
            vectors, tail = (min(MAX_VECTORS, left // width), width) if left >= width else (1, left)
            if next_rows > 0 and tile < tiles:
                lo, hi = next_rows * tile // tiles, next_rows * (tile + 1) // tiles
                prefetch_rows(a, next_off + lo * next_ld, hi - lo, next_ld, next_columns)
                tile += 1
            _tile(rows, vectors, tail, c, i0 * ldc + n0, ldc, a, i0 * a_rs, a_rs, a_cs, b, n0,
                  ldb, k, add, stream, blocks, a_block, b_block)  # fmt: skip
            n0 += vectors * width if tail == width else tail
        i0 += rows
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
        compiled = cfunc(_signature(numba.from_dtype(dtype)), cache=True)(_gemm)
        _COMPILED[slot] = compiled
        _ADDRESSES[slot] = compiled.address
    return _ADDRESSES


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
    hints do not overflow the core's queue of outstanding misses."""
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
