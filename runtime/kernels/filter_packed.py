"""Filter kernels on the packed layouts: every pass is a sequence of GEMMs on strided views.

With activations (H, W, C, N) and weights (P, R, Q, K, S, C) (see `layout`), output position
(p, q) reads input rows h0 + r, h0 = p·stride − pad_top, columns w0 .. w0 + S. For each window
row r that block is one contiguous (S·C)×N matrix X_r, and the weights of the position for that
row are one contiguous K×(S·C) matrix W_pq[r] = wp[p, r, q]. The three passes are then

    forward           Y_pq   = Σ_r W_pq[r] · X_r            (K×S·C)(S·C×N), into y[p, q]
    backward-data     dX_r  += W_pq[r]ᵀ · dY_pq             (S·C×K)(K×N), into dx rows h0 + r
    backward-filter   dW_pq[r] (+)= dY_pq · X_rᵀ             (K×N)(N×S·C)

R GEMMs per position and pass, each one `microkernel.tiled_gemm`, no im2col matrix, no gather.
That GEMM vectorises along the rows of its right operand and of its result, which are
unit-stride in the first two passes (along the batch) but not in the third, whose result runs
along (S, C) while X_r runs along the batch: backward-filter reads the input through one
(H, N, W, C) copy made per call (activation-sized, against the weight-sized gradient it writes;
in the thread's kept temporary, `runtime.aligned.scratch_empty`), whose rows per example run
along (S, C). Zero padding clips the window
instead of padding the tensor: rows and columns that fall outside the input are left out of
the GEMM (and their weight-gradient block is zeroed). A channel subset lo:hi of the weight
gradient (a sparse update) copies only those channels, so its GEMMs are
K×(S·(hi−lo))×N and the other channels cost nothing.

Weights are read through their strides (the Numba kernels index a (P, Q, R, K, S, C) view of
them), so any view whose (S, C) axes form one unit-stride row is an operand as it is: a piece
of positions `wp[p0:p1, :, q0:q1]` or of output channels `wp[:, :, :, k0:k1]` (a
model-parallel piece) costs no copy. A weight gradient `out` may be such a view too.

The untied backward-filter's result is as large as the weights (585 MB a call at the seed's L1
shape, batch 64) and each element is only 2·N FLOPs: stored through the caches, every line it
writes is first read, and the pass ran at 69% of SGEMM at batch 64. Its products store their
tiles past the caches (`microkernel.STREAM`, where the gradient's rows are vector-aligned, as
the runtime's buffers are).

Parallelism (Numba threads, one thread per GEMM): forward and untied
backward-filter split output positions, which write disjoint blocks; backward-data splits
input rows, so the overlapping windows of one row accumulate on one thread; tied
backward-filter gives each thread its own partial gradient and sums them at the end.
Numba's default static schedule (one block of consecutive positions per thread) is kept on
purpose: neighbouring positions share most of their input window, and handing positions out
one at a time measured up to 40% slower (tied backward-filter, batch 64, with BLAS products).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from runtime.aligned import aligned_empty, scratch_empty
from runtime.kernels import filter_one_example as one_example
from runtime.kernels.geometry import Geometry, check_dtypes, check_ndim, make_geometry
from runtime.kernels.layout import canonical_unit_strides
from runtime.kernels.microkernel import (
    ACCUMULATE,
    STREAM,
    WRITE,
    kernels,
    tiled_gemm,
    tiled_gemm_prefetching,
    tiled_gemm_sum,
)
from runtime.kernels.threaded import inner, threaded
from runtime.kernels.update import OptimizerStep, run_view, step_elements
from runtime.kernels.windows import clip, reading_row


@threaded
def _forward(x, w, y, stride, pad_top, pad_left, untied, kernels):
    h, wd, c, n = x.shape
    p_out, q_out, k, _ = y.shape
    r_size, s_size = w.shape[2], w.shape[4]
    size = x.itemsize
    xs0, xs1, xs2 = x.strides[0] // size, x.strides[1] // size, x.strides[2] // size
    ys0, ys1, ys2 = y.strides[0] // size, y.strides[1] // size, y.strides[2] // size
    ws0, ws1, ws2 = w.strides[0] // size, w.strides[1] // size, w.strides[2] // size
    ws3, ws4 = w.strides[3] // size, w.strides[4] // size
    for pq in prange(p_out * q_out):
        p, q = pq // q_out, pq % q_out
        h0, w0 = p * stride - pad_top, q * stride - pad_left
        r_lo, r_hi = clip(h0, r_size, h)
        s_lo, s_hi = clip(w0, s_size, wd)
        if s_hi <= s_lo:
            r_hi = r_lo
        w_at = p * ws0 + q * ws1 if untied else 0
        # one product over the window's rows: the tile stays in registers from row to row
        tiled_gemm_sum(kernels, k, n, (s_hi - s_lo) * c, r_hi - r_lo,
                       w, w_at + r_lo * ws2 + s_lo * ws4, ws3, 1, ws2,
                       x, (h0 + r_lo) * xs0 + (w0 + s_lo) * xs1, xs2, xs0,
                       False, y, p * ys0 + q * ys1, ys2)  # fmt: skip


@threaded
def _backward_data(dy, w, dx, stride, pad_top, pad_left, untied, kernels):
    h, wd, c, n = dx.shape
    p_out, q_out, k, _ = dy.shape
    r_size, s_size = w.shape[2], w.shape[4]
    size = dx.itemsize
    gs0, gs1, gs2 = dy.strides[0] // size, dy.strides[1] // size, dy.strides[2] // size
    xs0, xs1, xs2 = dx.strides[0] // size, dx.strides[1] // size, dx.strides[2] // size
    ws0, ws1, ws2 = w.strides[0] // size, w.strides[1] // size, w.strides[2] // size
    ws3, ws4 = w.strides[3] // size, w.strides[4] // size
    for row in prange(h):
        dx[row] = 0
        for r in range(r_size):
            p = reading_row(row, r, pad_top, stride, p_out)
            if p < 0:
                continue
            for q in range(q_out):
                w0 = q * stride - pad_left
                s_lo, s_hi = clip(w0, s_size, wd)
                if s_hi <= s_lo:
                    continue
                w_at = p * ws0 + q * ws1 if untied else 0
                # the next block (position q + 1) is the one after this in memory
                ahead = k if untied and q + 1 < q_out else 0
                tiled_gemm_prefetching(kernels, (s_hi - s_lo) * c, n, k,
                                       w, w_at + r * ws2 + s_lo * ws4, 1, ws3,
                                       dy, p * gs0 + q * gs1, gs2,
                                       True, dx, row * xs0 + (w0 + s_lo) * xs1, xs2,
                                       w_at + ws1 + r * ws2, ahead, ws3, s_size * c)  # fmt: skip


@threaded
def _batch_major(x, xt, c_lo):
    """xt (H, N, W, Cs) = channels c_lo:c_lo + Cs of x (H, W, C, N): the backward-filter's B
    operand, whose rows (one per example) run along a window row's (S, Cs) elements, the weight
    gradient's unit-stride axis."""
    h, n, wd, cs = xt.shape
    for hw in prange(h * wd):
        row, col = hw // wd, hw % wd
        for b in range(n):
            for ch in range(cs):
                xt[row, b, col, ch] = x[row, col, c_lo + ch, b]


@inner
def _filter_gradient_at(dy, xt, dw, i, j, p, q, stride, pad_top, pad_left, accumulate, write,
                        kernels):  # fmt: skip
    """dW of output position (p, q) into dw[i, j] (indexed (P, Q, R, K, S, Cs)), one window
    row at a time (`_gradient_block`)."""
    for r in range(dw.shape[2]):
        _gradient_block(dy, xt, dw, i, j, r, p, q, r, stride, pad_top, pad_left, accumulate,
                        write, kernels)  # fmt: skip


@inner
def _gradient_block(dy, xt, dw, i, j, rr, p, q, r, stride, pad_top, pad_left, accumulate,
                    write, kernels):  # fmt: skip
    """Window row r of output position (p, q)'s dW into dw[i, j, rr] (dw indexed (P, Q, R, K,
    S, Cs)), the K×(S·Cs) matrix addressed through dw's strides; `xt` holds the input's Cs
    channels in (H, N, W, Cs) (see `_batch_major`). A row or columns outside the input give
    zeros (or add nothing). `write`: how a block not added to is stored (`microkernel.WRITE`,
    or `STREAM` past the caches)."""
    h, n, wd, cs = xt.shape
    k, s_size = dw.shape[3], dw.shape[4]
    size = xt.itemsize
    gs0, gs1, gs2 = dy.strides[0] // size, dy.strides[1] // size, dy.strides[2] // size
    ts0, ts1, ts2 = xt.strides[0] // size, xt.strides[1] // size, xt.strides[2] // size
    ds3, ds4 = dw.strides[3] // size, dw.strides[4] // size
    at = i * (dw.strides[0] // size) + j * (dw.strides[1] // size) + rr * (dw.strides[2] // size)
    row, w0 = p * stride - pad_top + r, q * stride - pad_left
    s_lo, s_hi = clip(w0, s_size, wd)
    inside = 0 <= row < h and s_lo < s_hi
    add = accumulate
    if not accumulate and (not inside or s_lo > 0 or s_hi < s_size):
        dw[i, j, rr] = 0
        add = True
    if inside:
        tiled_gemm(kernels, k, (s_hi - s_lo) * cs, n,
                   dy, p * gs0 + q * gs1, gs2, 1,
                   xt, row * ts0 + (w0 + s_lo) * ts2, ts1,
                   ACCUMULATE if add else write, dw, at + s_lo * ds4, ds3)  # fmt: skip


@threaded
def _backward_filter_untied(dy, xt, dw, stride, pad_top, pad_left, accumulate, kernels):
    q_out = dy.shape[1]
    for pq in prange(dy.shape[0] * q_out):
        i, j = pq // q_out, pq % q_out
        # the untied gradient is as large as the weights, written once and read by the update:
        # past the caches (`microkernel.STREAM`)
        _filter_gradient_at(dy, xt, dw, i, j, i, j, stride, pad_top, pad_left, accumulate, STREAM,
                            kernels)  # fmt: skip


@threaded
def _step_untied(dy, xt, stride, pad_top, pad_left, kernels, rule, co, p, s1, s2, scratch):
    """The optimizer's `rule` steps the weights p (and their state s1, s2, all indexed (P, Q,
    R, K, S, C)) by their gradient, which is not stored: each block of it (a position's window
    row) goes into the thread's block of `scratch` and from there into the step. The blocks
    are walked in the packed arrays' order (P, R, Q), so that each thread streams one run of
    p, s1 and s2 from memory; by position, it crossed R runs of each at once and the step ran
    at a third of its streaming rate. A kernel of its own, not a branch of the one that stores
    the gradient: a run compiles only what it calls (a parallel loop is about a second of
    compiling on a cold cache)."""
    p_out, q_out, r_size = dy.shape[0], dy.shape[1], p.shape[2]
    for block in prange(p_out * r_size * q_out):
        i, r, j = block // (r_size * q_out), (block // q_out) % r_size, block % q_out
        thread = numba.get_thread_id()
        _gradient_block(dy, xt, scratch, thread, 0, 0, i, j, r, stride, pad_top, pad_left,
                        False, WRITE, kernels)  # fmt: skip
        _step_block(rule, co, scratch, thread, p, s1, s2, i, j, r)


@inner
def _step_block(rule, co, g, thread, p, s1, s2, i, j, r):
    """The step of weights p[i, j, r] from their gradient, block `thread` of g: one run of
    K·S·C elements where the rows of the output channels are contiguous, as in the packed
    arrays, else one of S·C per output channel."""
    k, s_size, c = p.shape[3:]
    size = p.itemsize
    at = i * (p.strides[0] // size) + j * (p.strides[1] // size) + r * (p.strides[2] // size)
    ps3, gs0, gs3 = p.strides[3] // size, g.strides[0] // size, g.strides[3] // size
    row = s_size * c
    channels, run = (1, k * row) if ps3 == row and gs3 == row else (k, row)
    for kk in range(channels):
        g_at, p_at = thread * gs0 + kk * gs3, at + kk * ps3
        step_elements(rule, co, run_view(g, g_at, run), run_view(p, p_at, run),
                      run_view(s1, p_at, run), run_view(s2, p_at, run))  # fmt: skip


@threaded
def _backward_filter_tied(dy, xt, dw, stride, pad_top, pad_left, accumulate, threads, kernels):
    q_out = dy.shape[1]
    r_size, k, s_size, cs = dw.shape[2:]
    partial = np.zeros((threads, 1, r_size, k, s_size, cs), dw.dtype)
    for pq in prange(dy.shape[0] * q_out):
        p, q = pq // q_out, pq % q_out
        thread = numba.get_thread_id()
        _filter_gradient_at(
            dy, xt, partial, thread, 0, p, q, stride, pad_top, pad_left, True, WRITE, kernels
        )
    total = partial.sum(axis=0)
    if accumulate:
        dw[0] += total
    else:
        dw[0] = total


def packed_geometry(xp_shape: tuple, wp_shape: tuple, stride: int, pad) -> Geometry:
    """The geometry of (H, W, C, N) activations under (P, R, Q, K, S, C) weights."""
    h, w, c, n = xp_shape
    wp, r, wq, k, s, wc = wp_shape
    return make_geometry((n, c, h, w), (k, wc, r, s, wp, wq), stride, pad, "xp", "wp")


def _operand(a: np.ndarray) -> np.ndarray:
    """`a` itself when its (W, C) axes read as one and its last axis is unit-stride.

    The kernels take leading dimensions from the strides, so a length-1 axis (batch 1, one
    channel) must carry the stride a contiguous array would give it: NumPy leaves such strides
    arbitrary (a transposed view keeps its old ones) and calls the array contiguous anyway."""
    a = canonical_unit_strides(a)
    size = a.itemsize
    if a.strides[3] == size and a.strides[1] == a.shape[2] * a.strides[2] and min(a.strides) > 0:
        return a
    return canonical_unit_strides(np.array(a, order="C", copy=True))


def _by_position(wp: np.ndarray) -> np.ndarray:
    """The (P, Q, R, K, S, C) view of packed (P, R, Q, K, S, C) weights that the kernels index
    (its own inverse)."""
    return wp.transpose(0, 2, 1, 3, 4, 5)


def _blocks_addressable(wp: np.ndarray) -> bool:
    """Whether each K×(S·C) block wp[p, r, q] of (canonical) weights reads as a matrix.

    That holds for the packed arrays and for any slice of positions or output channels of one:
    the (S, C) axes read as one unit-stride row and rows are at least S·C apart."""
    size, (s, c), strides = wp.itemsize, wp.shape[4:], wp.strides
    return (
        strides[5] == size
        and strides[4] == c * size
        and strides[3] >= s * c * size
        and min(strides) > 0
        and all(v % size == 0 for v in strides)
    )


def accumulates_in_place(dw: np.ndarray) -> bool:
    """Whether `backward_filter_packed` can write into the packed weight gradient view `dw` as
    its `out`: a whole gradient or a piece of its positions or output channels, not a piece of
    its input channels."""
    return dw.ndim == 6 and dw.flags.writeable and _blocks_addressable(canonical_unit_strides(dw))


def _weights(wp: np.ndarray) -> np.ndarray:
    """`wp` itself when its blocks are addressable, else a C-contiguous copy."""
    wp = canonical_unit_strides(wp)
    if _blocks_addressable(wp):
        return wp
    return canonical_unit_strides(np.array(wp, order="C", copy=True))


def _output(name: str, out: np.ndarray | None, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """The output array, left as it is: every kernel writes each element of its output (the
    first product into a block does not read it, and clipped or empty windows are zeroed)."""
    if out is None:
        return aligned_empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"{name}: expected shape {shape} {dtype}, got {out.shape} {out.dtype}")
    out = canonical_unit_strides(out)
    addressable = _operand(out) is out if out.ndim == 4 else _blocks_addressable(out)
    if not addressable:
        raise ValueError(f"{name}: layout with strides {out.strides} is not addressable")
    return out


def _check_dy(dyp: np.ndarray, geo: Geometry) -> None:
    expected = (geo.p, geo.q, geo.k, geo.n)
    if dyp.shape != expected:
        raise ValueError(f"dyp: expected (P, Q, K, N) = {expected}, got shape {dyp.shape}")


def forward_packed(
    xp: np.ndarray, wp: np.ndarray, stride: int = 1, pad=0, out: np.ndarray | None = None
) -> np.ndarray:
    """y (P, Q, K, N) of x (H, W, C, N) under weights (P|1, R, Q|1, K, S, C)."""
    check_ndim("xp", xp, 4, "(H, W, C, N)")
    check_ndim("wp", wp, 6, "(P, R, Q, K, S, C)")
    dtype = check_dtypes(xp=xp, wp=wp)
    geo = packed_geometry(xp.shape, wp.shape, stride, pad)
    y = _output("out", out, (geo.p, geo.q, geo.k, geo.n), dtype)
    if min(geo.n, geo.k, geo.c) == 0:
        y[...] = 0
        return y
    if one_example.by_example(geo, dtype, geo.k):
        # (R, S·C, K): a copy of the weights, against the output's P·Q·K·S·C·R products
        wt = np.ascontiguousarray(wp[0, :, 0].transpose(0, 2, 3, 1)).reshape(
            geo.r, geo.s * geo.c, geo.k
        )
        args = (geo.stride, geo.pad[0], geo.pad[2], kernels(dtype))
        for b in range(geo.n):
            with one_example.written(y, b) as y_b:
                one_example.forward(one_example.operand(xp, b), wt, y_b, *args)
        return y
    w = _by_position(_weights(wp))
    _forward(_operand(xp), w, y, geo.stride, geo.pad[0], geo.pad[2], geo.untied, kernels(dtype))
    return y


def backward_data_packed(
    dyp: np.ndarray,
    wp: np.ndarray,
    input_size: tuple[int, int],
    stride: int = 1,
    pad=0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """dx (H, W, C, N) from dy (P, Q, K, N), for an H×W input (`input_size`)."""
    check_ndim("dyp", dyp, 4, "(P, Q, K, N)")
    check_ndim("wp", wp, 6, "(P, R, Q, K, S, C)")
    dtype = check_dtypes(dyp=dyp, wp=wp)
    h, w = input_size
    geo = packed_geometry((h, w, wp.shape[5], dyp.shape[3]), wp.shape, stride, pad)
    _check_dy(dyp, geo)
    dx = _output("out", out, (geo.h, geo.w, geo.c, geo.n), dtype)
    if min(geo.n, geo.k, geo.c) == 0:
        dx[...] = 0
        return dx
    w = _by_position(_weights(wp))
    if one_example.by_example(geo, dtype, geo.c):
        args = (geo.stride, geo.pad[0], geo.pad[2], kernels(dtype))
        for b in range(geo.n):
            with one_example.written(dx, b) as dx_b:
                one_example.backward_data(one_example.operand(dyp, b), w, dx_b, *args)
        return dx
    args = (geo.stride, geo.pad[0], geo.pad[2], geo.untied, kernels(dtype))
    _backward_data(_operand(dyp), w, dx, *args)
    return dx


def backward_filter_packed(
    dyp: np.ndarray,
    xp: np.ndarray,
    window: tuple[int, int],
    stride: int = 1,
    pad=0,
    untied: bool = True,
    channels: tuple[int, int] | None = None,
    out: np.ndarray | None = None,
    accumulate: bool = False,
    step: OptimizerStep | None = None,
) -> np.ndarray | None:
    """dw (P|1, R, Q|1, K, S, hi−lo) from dy (P, Q, K, N) and x (H, W, C, N).

    `channels` (lo, hi) restricts the gradient to input channels lo:hi, skipping the others'
    work; `accumulate` adds into `out` (a reduction over batch pieces) instead of overwriting.
    With a `step` (an optimizer's step over weights of dw's shape, `runtime.kernels.update`),
    dw is not kept: each block of it steps the weights while it is in cache, and the call
    returns None.
    """
    check_ndim("dyp", dyp, 4, "(P, Q, K, N)")
    check_ndim("xp", xp, 4, "(H, W, C, N)")
    dtype = check_dtypes(dyp=dyp, xp=xp)
    if len(window) != 2:
        raise ValueError(f"window: expected (R, S), got {window!r}")
    if step is not None and (out is not None or accumulate):
        raise ValueError("step: the gradient is not kept, so there is no out to write or add to")
    r, s = (int(v) for v in window)
    c = xp.shape[2]
    p, q = (dyp.shape[0], dyp.shape[1]) if untied else (1, 1)
    geo = packed_geometry(xp.shape, (p, r, q, dyp.shape[2], s, c), stride, pad)
    _check_dy(dyp, geo)
    lo, hi = check_channels(channels, c)
    shape = (p, r, q, geo.k, s, hi - lo)
    if step is not None and not _steps_in_kernel(step, shape, geo.untied, dtype):
        dw = backward_filter_packed(dyp, xp, window, stride, pad, untied, channels)
        step.apply(dw)
        return None
    empty = min(geo.n, geo.k, hi - lo) == 0
    if step is not None and empty:  # a zero gradient still moves the weights (momentum, Adam)
        step.apply(np.zeros(shape, dtype))
        return None
    dw = None if step is not None else _output("out", out, shape, dtype)
    if empty:
        if not accumulate:
            dw[...] = 0
        return dw
    if one_example.by_example(geo, dtype, hi - lo) and step is None:
        dw = canonical_unit_strides(dw)
        for b in range(geo.n):  # the examples' gradients summed, the first written unless added
            adding = ACCUMULATE if accumulate or b > 0 else WRITE
            dy_b, x_b = one_example.operand(dyp, b), one_example.operand(xp, b)
            one_example.backward_filter(dy_b, x_b, dw, lo, geo.stride, geo.pad[0], geo.pad[2],
                                        adding, kernels(dtype))  # fmt: skip
        return dw
    xt = scratch_empty("batch-major input", (geo.h, geo.n, geo.w, hi - lo), dtype)
    _batch_major(xp, xt, lo)
    if step is not None:
        threads = numba.config.NUMBA_NUM_THREADS
        scratch = aligned_empty((threads, 1, 1, geo.k, s, hi - lo), dtype)
        operands = tuple(_by_position(a) for a in step.operands)
        _step_untied(_operand(dyp), xt, geo.stride, geo.pad[0], geo.pad[2], kernels(dtype),
                     step.rule, step.coefficients, *operands, scratch)  # fmt: skip
        return None
    args = (_operand(dyp), xt, _by_position(dw), geo.stride, geo.pad[0], geo.pad[2], accumulate)
    if geo.untied:
        _backward_filter_untied(*args, kernels(dtype))
    else:
        # one partial per thread of the pool, since thread ids range over all of it
        _backward_filter_tied(*args, numba.config.NUMBA_NUM_THREADS, kernels(dtype))
    return dw


def _steps_in_kernel(step: OptimizerStep, shape: tuple, untied: bool, dtype) -> bool:
    """Whether the untied kernel can step `step`'s weights itself: they are dw's shape and
    dtype, share their strides with their state, and each block reads as a matrix."""
    return (
        untied
        and step.params.dtype == dtype
        and step.shares_strides(shape)
        and all(a.ndim == 6 and a.flags.writeable for a in step.operands)
        and _blocks_addressable(canonical_unit_strides(step.params))
        and canonical_unit_strides(step.params) is step.params
    )


def check_channels(channels: tuple[int, int] | None, c: int) -> tuple[int, int]:
    """(lo, hi) with 0 <= lo <= hi <= c; None means all c channels."""
    if channels is None:
        return 0, c
    lo, hi = channels
    if not 0 <= lo <= hi <= c:
        raise ValueError(f"channels: expected 0 <= lo <= hi <= {c}, got {channels!r}")
    return int(lo), int(hi)
