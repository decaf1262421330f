"""Transposing copies in registers: `transpose_heads` writes scale · aᵀ for every head of a
batch, square tiles of one vector's lanes at a time.

Attention's GEMM reads its right operand by rows, so the scores Q·Kᵀ need Kᵀ laid out, a copy
of T·D elements a head. NumPy's copy reads each element a row of the head apart: in
`bench/attention_products.py` on the AMD EPYC VM it took 0.24 ms beside the scores' 0.31 ms
GEMM at (16, 4, 128, 64), and a compiled element loop was no faster. Here a tile of L×L
elements (L = the lanes of the host's vector, 16 float32 with AVX-512) is loaded as L row
vectors, transposed by log₂ L rounds of shuffles (each round swaps the off-diagonal blocks of
every 2s×2s block, s = L/2, …, 1), scaled, and stored as L row vectors of the output. The
edges that do not fill a tile are copied element by element.
"""

from __future__ import annotations

from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from runtime.kernels.gemm_tile import lanes
from runtime.kernels.llvm_memory import element_pointer
from runtime.kernels.threaded import threaded

LANES_FLOAT32 = lanes(4)
LANES_FLOAT64 = lanes(8)
_I32 = ir.IntType(32)


def _swap_masks(width: int, step: int) -> tuple[list[int], list[int]]:
    """The shuffle masks of a round: rows a and b (b = a + step) become a's and b's columns
    with the off-diagonal step×step blocks of each 2·step block swapped."""
    upper = [k if not k & step else width + k - step for k in range(width)]
    lower = [k + step if not k & step else width + k for k in range(width)]
    return upper, lower


@intrinsic
def _tile(typingctx, src, src_off, src_rs, dst, dst_off, dst_rs, scale):
    """dst[dst_off + c·dst_rs + r] = scale · src[src_off + r·src_rs + c] for r, c < L."""
    if not (src.dtype == dst.dtype == scale and scale in (types.float32, types.float64)):
        return None
    i = types.intp
    sig = types.void(src, i, i, dst, i, i, scale)

    def codegen(context, builder, signature, args):
        src_, src_off_, src_rs_, dst_, dst_off_, dst_rs_, scale_ = args
        dtype = signature.args[0].dtype
        size = dtype.bitwidth // 8
        width = lanes(size)
        vty = ir.VectorType(context.get_value_type(dtype), width)
        vptr = vty.as_pointer()
        src_ptr = element_pointer(context, builder, signature.args[0], src_, src_off_)
        dst_ptr = element_pointer(context, builder, signature.args[3], dst_, dst_off_)
        index = src_rs_.type
        splat = builder.insert_element(ir.Constant(vty, ir.Undefined), scale_, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(
            splat, splat, ir.Constant(ir.VectorType(_I32, width), [0] * width)
        )
        rows = []
        for r in range(width):
            at = builder.gep(src_ptr, [builder.mul(src_rs_, ir.Constant(index, r))])
            loaded = builder.load(builder.bitcast(at, vptr), align=size)
            rows.append(builder.fmul(loaded, splat))
        step = width // 2
        while step:
            upper, lower = (
                ir.Constant(ir.VectorType(_I32, width), mask) for mask in _swap_masks(width, step)
            )
            for a in range(width):
                if a & step:
                    continue
                b = a + step
                rows[a], rows[b] = (
                    builder.shuffle_vector(rows[a], rows[b], upper),
                    builder.shuffle_vector(rows[a], rows[b], lower),
                )
            step //= 2
        for c in range(width):
            at = builder.gep(dst_ptr, [builder.mul(dst_rs_, ir.Constant(index, c))])
            builder.store(rows[c], builder.bitcast(at, vptr), align=size)
        return context.get_dummy_value()

    return sig, codegen


@threaded
def transpose_heads(a, a_n, a_h, a_r, a_c, batch, heads, rows, columns, scale, out):
    """out[i, j] = scale · a[i, j]ᵀ for every (i, j) of the (`batch`, `heads`) leading dims: `a`
    a flat array from its first element read through its strides in elements (per leading
    index `a_n`, `a_h`, per row `a_r`, per column `a_c`), `out` a flat C-contiguous
    (batch, heads, columns, rows) array; `scale` of their dtype. Tiles in registers where the
    head's rows are of unit stride, element by element elsewhere."""
    width = LANES_FLOAT32 if out.itemsize == 4 else LANES_FLOAT64
    for t in prange(batch * heads):
        source, target = (t // heads) * a_n + (t % heads) * a_h, t * rows * columns
        tiled_rows = rows - rows % width if a_c == 1 else 0
        tiled_columns = columns - columns % width if a_c == 1 else 0
        for r0 in range(0, tiled_rows, width):
            for c0 in range(0, tiled_columns, width):
                _tile(a, source + r0 * a_r + c0, a_r, out, target + c0 * rows + r0, rows, scale)
        for c in range(columns):
            first = tiled_rows if c < tiled_columns else 0
            for r in range(first, rows):
                out[target + c * rows + r] = a[source + r * a_r + c * a_c] * scale
