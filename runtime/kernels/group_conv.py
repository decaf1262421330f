"""The `group_conv` op: a tied convolution whose channels fall into groups (ONNX Conv `group`).

x is (N, C, H, W); w is (K, 1, 1, C/g, R, S, 1, 1): output channel k belongs to group
k // (K/g) and reads only that group's C/g input channels, so axis 3 of w holds the input
channels of one group and ONNX's (K, C/g, R, S) weights reshape straight into it. b is (1, K, 1, 1)
or None. `pad` is an int or (top, bottom, left, right).

Two paths compute the same sums. With many input channels per group (`GEMM_CHANNELS` or more)
each group is an ordinary convolution, run by the GEMM-based filter kernels on the group's slices.
With few (depthwise: one), a GEMM would be a sliver of a matrix per group and its layout
conversions would cost more than the arithmetic, so direct Numba loops run every group at once
(see the phase planes below).

The piece entry points take views that start mid-tensor, as the executor cuts them: output
channels [k0, k0 + Kp) and, per group, input channels [c0, c0 + Cp). The input view then starts at
channel g0·Cg + c0 (g0 = k0 // Kg, the piece's first group) and a piece of groups g0..g1 reads
channels (g − g0)·Cg + [0, Cp) of it for group g: the channels between are read by the access map
(a rect cannot skip them) and get no work and a zero gradient.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from runtime.kernels.filter import filter_backward, filter_forward
from runtime.kernels.geometry import check_dtypes, check_ndim, normalize_pad, normalize_stride
from runtime.kernels.threaded import inner, threaded

#: input channels per group from which the GEMM path is the faster. Measured on one core, float32,
#: forward plus backward: at 4 channels the direct loops win about 2× on 1×1 and 3×3 windows, at 8
#: the GEMMs win 1.7–2.4×; depthwise 3×3 the direct loops win 2.3× at stride 2 and 6× at stride 1.
GEMM_CHANNELS = 8

PATHS = ("gemm", "direct")


def _path(cp: int, path: str | None) -> str:
    if path is None:
        return "gemm" if cp >= GEMM_CHANNELS else "direct"
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, got {path!r}")
    return path


def _plain_weights(w: np.ndarray) -> np.ndarray:
    check_ndim("w", w, 8, "(K, 1, 1, C/groups, R, S, 1, 1)")
    if w.shape[1:3] != (1, 1) or w.shape[6:] != (1, 1):
        raise ValueError(f"w: axes 1, 2, 6 and 7 must be unit axes (tied), got shape {w.shape}")
    return w[:, 0, 0, :, :, :, 0, 0]


def _layout(x, w, k0: int, k_per_group: int, c_per_group: int):
    """The offsets in x's channels of each output channel's group, and the runs of output
    channels sharing a group, ((k_lo, k_hi, offset), ...), checked against x."""
    if k_per_group < 1 or c_per_group < 1 or k0 < 0:
        raise ValueError(
            f"k0 {k0}, k_per_group {k_per_group} and c_per_group {c_per_group} must be "
            "non-negative and positive"
        )
    kp, cp = w.shape[0], w.shape[3]
    if cp > c_per_group:
        raise ValueError(f"w: {cp} input channels exceed the {c_per_group} of a group")
    first = k0 // k_per_group
    groups = (np.arange(k0, k0 + kp) // k_per_group - first).astype(np.int64)
    offsets = groups * c_per_group
    needed = int(offsets[-1]) + cp if kp else 0
    if x.shape[1] != needed:
        raise ValueError(
            f"x: output channels [{k0}, {k0 + kp}) in groups of {k_per_group}, {cp} input "
            f"channels each, read {needed} channels; x has {x.shape[1]} (shape {x.shape})"
        )
    runs = []
    for lo in range(kp):
        if lo == 0 or groups[lo] != groups[lo - 1]:
            runs.append([lo, lo + 1, int(offsets[lo])])
        else:
            runs[-1][1] = lo + 1
    return offsets, tuple(tuple(run) for run in runs)


def _out_size(x, w4, stride: int, pads) -> tuple[int, int]:
    _, _, height, width = x.shape
    _, _, kr, ks = w4.shape
    out_h = (height + pads[0] + pads[1] - kr) // stride + 1
    out_w = (width + pads[2] + pads[3] - ks) // stride + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(f"w: window {kr}x{ks} does not fit x {x.shape} padded by {pads}")
    return out_h, out_w


def _bias_row(b, kp: int, dtype) -> np.ndarray:
    if b is None:
        return np.zeros(kp, dtype)
    if b.shape != (1, kp, 1, 1):
        raise ValueError(f"b: expected (1, {kp}, 1, 1), got shape {b.shape}")
    return np.ascontiguousarray(b.reshape(kp), dtype=dtype)


# The direct kernels work on "phase planes": the zero-padded input plane cut, for stride t, into
# t×t planes of every t-th row and column, (rows, cols) each, stored one after another in a flat
# buffer. Window element (r, s) of output (p, q) is then element (p + r // t, q + s // t) of
# phase (r % t, s % t), so for each weight one contiguous run of out_h·cols elements, a fixed
# offset into the buffer, lines up with the output laid out cols wide: the inner loops walk
# contiguous slices with no bounds to test, at any stride, and LLVM vectorises them (indexing a
# slice from 0, not the buffer at an offset, lets it drop Numba's negative-index checks). The
# cols − out_w columns past each output row are scratch: they read elements of the next row,
# and the gradient kernels keep zeros there so that nothing real is added to or from them.


def _phase_size(x, w4, stride: int, pads, out_h: int, out_w: int) -> tuple[int, int]:
    """(rows, cols) of each phase plane: room for the padded input, for every window's reach
    past the last output, and one more row for the scratch columns' reads."""
    height, width = x.shape[2] + pads[0] + pads[1], x.shape[3] + pads[2] + pads[3]
    kr, ks = w4.shape[2], w4.shape[3]
    cols = max(-(-width // stride), out_w + (ks - 1) // stride)
    rows = max(-(-height // stride), out_h + (kr - 1) // stride) + 1
    return rows, cols


@inner
def _phase_at(r, s, stride, rows, cols):
    """Where window element (r, s)'s run starts in the phase buffer."""
    return ((r % stride) * stride + s % stride) * rows * cols + (r // stride) * cols + s // stride


@inner
def _phase_copy(plane, top, left, stride, rows, cols, phases, into_phases):
    """An input plane (H, W) into the phase buffer (`into_phases`; its padding elements stay as
    they are), or the buffer's input-plane elements back into the plane: the one index map
    read both ways."""
    height, width = plane.shape
    size = rows * cols
    for h in range(height):
        row = ((h + top) % stride) * stride * size + ((h + top) // stride) * cols
        for b in range(stride):
            first = (b - left) % stride
            if first >= width:
                continue
            count = (width - 1 - first) // stride + 1
            at = row + b * size + (first + left) // stride
            buffered = phases[at : at + count]
            strided = plane[h, first : first + (count - 1) * stride + 1 : stride]
            if into_phases:
                for v in range(count):
                    buffered[v] = strided[v]
            else:
                for v in range(count):
                    strided[v] = buffered[v]


@inner
def _to_rows(out, cols, flat):
    """An output plane (P, Q) into rows cols wide (the scratch columns are left alone)."""
    out_h, out_w = out.shape
    for p in range(out_h):
        dst = flat[p * cols : p * cols + out_w]
        src = out[p]
        for q in range(out_w):
            dst[q] = src[q]


@inner
def _from_rows(flat, cols, out):
    out_h, out_w = out.shape
    for p in range(out_h):
        src = flat[p * cols : p * cols + out_w]
        dst = out[p]
        for q in range(out_w):
            dst[q] = src[q]


@inner(fastmath={"reassoc", "contract"})
def _dot(a, b):
    # a sum in any order is within the same γ(n) bound; reassociation lets LLVM keep one
    # partial sum per vector lane instead of adding every product in turn
    total = a[0] * b[0]
    for i in range(1, a.shape[0]):
        total += a[i] * b[i]
    return total


@threaded
def _forward_direct(x, w, bias, offsets, stride, top, left, rows, cols, y):
    batch = x.shape[0]
    kp, cp, kr, ks = w.shape
    span = y.shape[2] * cols
    for t in prange(batch * kp):
        n = t // kp
        k = t - n * kp
        phases = np.zeros(stride * stride * rows * cols, x.dtype)
        acc = np.empty(span, x.dtype)
        acc[:] = bias[k]
        for c in range(cp):
            _phase_copy(x[n, offsets[k] + c], top, left, stride, rows, cols, phases, True)
            for r in range(kr):
                for s in range(ks):
                    weight = w[k, c, r, s]
                    at = _phase_at(r, s, stride, rows, cols)
                    src = phases[at : at + span]
                    for i in range(span):
                        acc[i] += weight * src[i]
        _from_rows(acc, cols, y[n, k])


@threaded
def _backward_data_direct(dy, w, offsets, run_lo, run_hi, stride, top, left, rows, cols, dx):
    # a run's output channels all add into their group's input channels: one thread per
    # (sample, run) owns those channels of dx, so no two threads add into the same element
    batch = dy.shape[0]
    _, cp, kr, ks = w.shape
    span = dy.shape[2] * cols
    runs = run_lo.shape[0]
    for t in prange(batch * runs):
        n = t // runs
        g = t - n * runs
        phases = np.empty(stride * stride * rows * cols, dy.dtype)
        grad = np.zeros(span, dy.dtype)  # zero in the scratch columns, for good
        for c in range(cp):
            phases[:] = 0
            for k in range(run_lo[g], run_hi[g]):
                _to_rows(dy[n, k], cols, grad)
                for r in range(kr):
                    for s in range(ks):
                        weight = w[k, c, r, s]
                        at = _phase_at(r, s, stride, rows, cols)
                        dst = phases[at : at + span]
                        for i in range(span):
                            dst[i] += weight * grad[i]
            _phase_copy(dx[n, offsets[run_lo[g]] + c], top, left, stride, rows, cols, phases, False)


@threaded
def _backward_filter_direct(dy, x, offsets, stride, top, left, rows, cols, blocks, partial):
    # partial[b, k] holds the sum over sample block b: blocks × output channels are the
    # parallel units, so a few output channels still keep every core busy
    batch = dy.shape[0]
    _, kp, cp, kr, ks = partial.shape
    span = dy.shape[2] * cols
    for t in prange(blocks * kp):
        b = t // kp
        k = t - b * kp
        phases = np.zeros(stride * stride * rows * cols, x.dtype)
        grad = np.zeros(span, dy.dtype)  # zero in the scratch columns, for good
        sums = np.zeros((cp, kr, ks))
        for n in range(b * batch // blocks, (b + 1) * batch // blocks):
            _to_rows(dy[n, k], cols, grad)
            for c in range(cp):
                _phase_copy(x[n, offsets[k] + c], top, left, stride, rows, cols, phases, True)
                for r in range(kr):
                    for s in range(ks):
                        at = _phase_at(r, s, stride, rows, cols)
                        sums[c, r, s] += _dot(grad, phases[at : at + span])
        for c in range(cp):
            for r in range(kr):
                for s in range(ks):
                    partial[b, k, c, r, s] = sums[c, r, s]


def _blocks(batch: int, kp: int) -> int:
    """Sample blocks for the weight gradient: about two parallel units per thread."""
    threads = numba.get_num_threads()
    return max(1, min(batch, -(-2 * threads // max(kp, 1))))


def _check_common(x, w, stride, pads):
    check_ndim("x", x, 4, "(N, C, H, W)")
    w4 = _plain_weights(w)
    check_dtypes(x=x, w=w)
    return w4, normalize_stride(stride), normalize_pad(pads)


def group_conv_forward_piece(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    k0: int,
    k_per_group: int,
    c_per_group: int,
    stride: int = 1,
    pad=0,
    path: str | None = None,
) -> np.ndarray:
    """y (N, Kp, P, Q) of output channels [k0, k0 + Kp) for the views of a piece: x holds input
    channels from g0·Cg + c0 on, w is (Kp, 1, 1, Cp, R, S, 1, 1), b (1, Kp, 1, 1) or None.
    `path` forces "gemm" or "direct"; None picks by Cp (`GEMM_CHANNELS`)."""
    w4, stride, pads = _check_common(x, w, stride, pad)
    if b is not None:
        check_dtypes(x=x, b=b)
    offsets, runs = _layout(x, w, k0, k_per_group, c_per_group)
    kp, cp = w4.shape[0], w4.shape[1]
    out_h, out_w = _out_size(x, w4, stride, pads)
    bias = _bias_row(b, kp, x.dtype)
    if _path(cp, path) == "gemm":
        y = np.empty((x.shape[0], kp, out_h, out_w), x.dtype)
        for lo, hi, first in runs:
            part = x[:, first : first + cp]
            y[:, lo:hi] = filter_forward(part, w[lo:hi], stride, pads)
        if b is not None:
            y += bias.reshape(1, kp, 1, 1)
        return y
    y = np.empty((x.shape[0], kp, out_h, out_w), x.dtype)
    rows, cols = _phase_size(x, w4, stride, pads, out_h, out_w)
    x, w4 = np.ascontiguousarray(x), np.ascontiguousarray(w4)
    _forward_direct(x, w4, bias, offsets, stride, pads[0], pads[2], rows, cols, y)
    return y


def group_conv_backward_piece(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    k0: int,
    k_per_group: int,
    c_per_group: int,
    stride: int = 1,
    pad=0,
    need_dx: bool = True,
    path: str | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, dw, db) of a piece's views (as `group_conv_forward_piece`) for its incoming
    gradient dy (N, Kp, P, Q): dx like x (zero in the channels of x no group of the piece
    reads) or None without `need_dx`, dw like w, db (1, Kp, 1, 1)."""
    w4, stride, pads = _check_common(x, w, stride, pad)
    check_ndim("dy", dy, 4, "(N, K, P, Q)")
    check_dtypes(dy=dy, x=x)
    offsets, runs = _layout(x, w, k0, k_per_group, c_per_group)
    kp, cp = w4.shape[0], w4.shape[1]
    out_h, out_w = _out_size(x, w4, stride, pads)
    expected = (x.shape[0], kp, out_h, out_w)
    if dy.shape != expected:
        raise ValueError(f"dy: expected (N, K, P, Q) = {expected}, got shape {dy.shape}")
    db = dy.sum(axis=(0, 2, 3), dtype=np.float64).astype(dy.dtype).reshape(1, kp, 1, 1)
    dx = np.zeros(x.shape, x.dtype) if need_dx else None
    if _path(cp, path) == "gemm":
        dw = np.empty(w.shape, w.dtype)
        for lo, hi, first in runs:
            part = x[:, first : first + cp]
            dx_part, dw[lo:hi] = filter_backward(
                dy[:, lo:hi], part, w[lo:hi], stride, pads, need_dx=need_dx
            )
            if need_dx:
                dx[:, first : first + cp] = dx_part
        return dx, dw, db
    rows, cols = _phase_size(x, w4, stride, pads, out_h, out_w)
    dy, x, w4 = np.ascontiguousarray(dy), np.ascontiguousarray(x), np.ascontiguousarray(w4)
    top, left = pads[0], pads[2]
    if need_dx:
        run_lo = np.array([run[0] for run in runs], np.int64)
        run_hi = np.array([run[1] for run in runs], np.int64)
        _backward_data_direct(dy, w4, offsets, run_lo, run_hi, stride, top, left, rows, cols, dx)
    blocks = _blocks(x.shape[0], kp)
    partial = np.empty((blocks,) + w4.shape, w.dtype)
    _backward_filter_direct(dy, x, offsets, stride, top, left, rows, cols, blocks, partial)
    dw = partial.sum(axis=0).reshape(w.shape)
    return dx, dw, db


def _groups_of(x, w, groups: int) -> tuple[int, int]:
    """(K/g, C/g), checked."""
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    check_ndim("x", x, 4, "(N, C, H, W)")
    check_ndim("w", w, 8, "(K, 1, 1, C/groups, R, S, 1, 1)")
    k, cg = w.shape[0], w.shape[3]
    if k % groups:
        raise ValueError(f"w: {k} output channels do not split into {groups} groups")
    if x.shape[1] != groups * cg:
        raise ValueError(
            f"x: {x.shape[1]} input channels, but w's {cg} per group × {groups} groups "
            f"is {groups * cg}"
        )
    return k // groups, cg


def group_conv_forward(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    groups: int,
    stride: int = 1,
    pad=0,
    path: str | None = None,
) -> np.ndarray:
    """y (N, K, P, Q): output channel k the convolution of group k // (K/g)'s input channels
    by w[k] (K, 1, 1, C/g, R, S, 1, 1), plus b (1, K, 1, 1) when given."""
    kg, cg = _groups_of(x, w, groups)
    return group_conv_forward_piece(x, w, b, 0, kg, cg, stride, pad, path)


def group_conv_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    groups: int,
    stride: int = 1,
    pad=0,
    need_dx: bool = True,
    path: str | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, dw, db) for the incoming gradient dy (N, K, P, Q): dx like x (None without
    `need_dx`), dw like w, db (1, K, 1, 1)."""
    kg, cg = _groups_of(x, w, groups)
    return group_conv_backward_piece(dy, x, w, 0, kg, cg, stride, pad, need_dx, path)
