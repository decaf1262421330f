"""The memory side of the generated kernels (`gemm_tile`, `microkernel`, `transpose`): element
pointers, whether a pointer is to float32, cache-line prefetch hints, the fence after
non-temporal stores and a copy of a run of elements, as Numba intrinsics that emit one LLVM
instruction or call each."""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from runtime.aligned import LINE

_I32 = ir.IntType(32)


def element_pointer(context, builder, operand_type, operand, offset):
    """The address of element `offset` of an array or a typed pointer."""
    if isinstance(operand_type, types.CPointer):
        return builder.gep(operand, [offset])
    data = context.make_array(operand_type)(context, builder, operand).data
    return builder.gep(data, [offset])


@intrinsic
def store_fence(typingctx):
    """Wait for this thread's non-temporal stores: they are ordered with nothing else (x86's
    `sfence`; a full fence elsewhere), so whoever reads C after the kernel sees them."""

    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            sfence = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
            )
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def copy_run(typingctx, source, source_off, target, target_off, count):
    """target[target_off:][:count] = source[source_off:][:count] for arrays of one dtype, in
    elements: `llvm.memcpy`, which a loop of Numba's indexing (a check of each index's sign)
    ran some 3× slower than."""
    if not (isinstance(source, types.Array) and isinstance(target, types.Array)):
        return None
    if source.dtype != target.dtype:
        return None

    def codegen(context, builder, signature, args):
        types_ = signature.args
        read = element_pointer(context, builder, types_[0], args[0], args[1])
        write = element_pointer(context, builder, types_[2], args[2], args[3])
        itemsize = context.get_abi_sizeof(context.get_data_type(types_[0].dtype))
        cgutils.raw_memcpy(builder, write, read, args[4], itemsize)
        return context.get_dummy_value()

    return types.void(source, types.intp, target, types.intp, types.intp), codegen


@intrinsic
def is_single(typingctx, pointer):
    """Whether a typed pointer points at float32 (a constant of the compiled function)."""
    single = pointer.dtype == types.float32

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(single))

    return types.boolean(pointer), codegen


@intrinsic
def prefetch(typingctx, a, offset):
    """A hint to bring the cache line of a[offset] (in elements) into the caches."""
    if not isinstance(a, types.CPointer):
        return None

    def codegen(context, builder, signature, args):
        pointer = element_pointer(context, builder, signature.args[0], args[0], args[1])
        byte_ptr = builder.bitcast(pointer, ir.IntType(8).as_pointer())
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_ptr.type, _I32, _I32, _I32]),
            "llvm.prefetch.p0",
        )
        # read, keep in all levels, data cache
        builder.call(
            function, [byte_ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)]
        )
        return context.get_dummy_value()

    return types.void(a, types.intp), codegen


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(a, a_off, rows, ld, columns):
    """Prefetch `rows` rows of `columns` elements, `ld` apart, from a[a_off:]: one hint per
    cache line."""
    step = LINE // (4 if is_single(a) else 8)
    for i in range(rows):
        at = a_off + i * ld
        for j in range(0, columns, step):
            prefetch(a, at + j)
