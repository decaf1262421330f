"""One register tile of the GEMM (`microkernel`), emitted as LLVM vector code for the host:

    C[i, 0:w] (+)= Σ_l A[i·a_rs + l·a_cs] · B[l·ldb + 0:w]        for i < mr, l < depth

with mr rows of C held as `nv` vectors each in registers for the whole reduction, one vector
load of B's row per vector and one broadcast of A's element per row at each step; a tile given
lines to hint into the caches (the next product's A) sends one every 2**s steps, s the most
that still sends them all. B and C rows are read in place through their leading dimensions,
and A through any two strides, so the forward (A = the weights), backward-data (A = the
weights transposed) and backward-filter (A = the output gradient) passes all run on the
packed tensors without a copy of A.

The body is written as LLVM IR with vectors as wide as the host's registers (`VECTOR_BYTES`:
AVX-512, AVX2 or 128-bit) and `llvm.fmuladd` (one FMA where the host has them), inside a Numba
intrinsic, so it is compiled for the host ISA by Numba's own LLVM and cached like any other
Numba function. The tile shapes are chosen so the accumulators, B's vectors and a broadcast fit
in the vector register file (`MAX_ROWS` × `MAX_VECTORS` accumulators: 24 of AVX-512's 32
registers, 12 of AVX2's 16). A row narrower than a vector ends in one masked tile
(`llvm.masked.load` / `.store`), so every width is handled here and nothing falls back to BLAS.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from runtime.aligned import LINE
from runtime.kernels.llvm_memory import element_pointer


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
def tile_rows(left):
    """The rows of the next row tile with `left` rows of C to go: the most of `TILE_ROWS`."""
    for rows in TILE_ROWS:
        if left >= rows:
            return rows
    return 1


def lanes(itemsize: int) -> int:
    """Elements of one vector."""
    return VECTOR_BYTES // itemsize


_I32 = ir.IntType(32)


def _tile_body(builder, vty, rows, vectors, c, ldc, a, a_rs, a_cs, b, ldb, depth, accumulate,
               stream, blocks, a_block, b_block, hint, hint_lines, tail):  # fmt: skip
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
    # the hints (`hint_lines` cache lines from `hint` on) go out one every 2**shift steps of
    # the reduction, not all before the tile: a burst of them held every fill buffer of the
    # core, and the tile's own loads waited (see `microkernel.tiled_gemm_prefetching`)
    steps = builder.mul(blocks, depth)
    shift = ir.Constant(index, 0)
    for bit in range(1, 7):  # the most whose slots, steps >> shift, still cover the lines
        covers = builder.icmp_unsigned(
            ">=", builder.lshr(steps, ir.Constant(index, bit)), hint_lines
        )
        shift = builder.select(covers, ir.Constant(index, bit), shift)
    slot = builder.sub(builder.shl(ir.Constant(index, 1), shift), ir.Constant(index, 1))
    line_elements = ir.Constant(index, LINE // size)
    prefetch = cgutils.get_or_insert_function(
        module,
        ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
        "llvm.prefetch.p0",
    )
    # the products of `blocks` pairs (A, B), each `a_block` and `b_block` after the last, summed
    # in the same accumulators
    with cgutils.for_range(builder, blocks) as outer:
        b_first = builder.gep(b, [builder.mul(outer.index, b_block)])
        a_first = builder.mul(outer.index, a_block)
        done = builder.mul(outer.index, depth)
        with cgutils.for_range(builder, depth) as loop:
            _tile_step(builder, vty, fma, load, accs, rows, vectors, broadcast, a_rows, a_cs,
                       b_first, ldb, a_first, loop.index)  # fmt: skip
            step = builder.add(done, loop.index)
            line = builder.lshr(step, shift)
            due = builder.and_(
                builder.icmp_unsigned("==", builder.and_(step, slot), ir.Constant(index, 0)),
                builder.icmp_unsigned("<", line, hint_lines),
            )
            with builder.if_then(due):
                target = builder.gep(hint, [builder.mul(line, line_elements)])
                builder.call(prefetch, [builder.bitcast(target, ir.IntType(8).as_pointer()),
                                        ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                        ir.Constant(_I32, 1)])  # fmt: skip
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
def tile_product(
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
    hint_off,
    hint_lines,
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
            hint_off_,
            hint_lines_,
        ) = args
        operand_types = signature.args
        c_ptr = element_pointer(context, builder, operand_types[3], c_, c_off_)
        a_ptr = element_pointer(context, builder, operand_types[6], a_, a_off_)
        b_ptr = element_pointer(context, builder, operand_types[10], b_, b_off_)
        hint_ptr = element_pointer(context, builder, operand_types[6], a_, hint_off_)
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
                    a_block_, b_block_, hint_ptr, hint_lines_)  # fmt: skip
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
