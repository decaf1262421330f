"""The physical layouts of the filter and conv kernels, and conversions to them.

The logical layouts of the design (activations (N, C, H, W), weights (K, 1, 1, C, R, S, P, Q))
put the batch outermost and the output position innermost. The packed kernels use instead:

- activations, their gradients and layer outputs: (H, W, C, N), "HWCN". The R×S×C×N patch an
  output position reads is R blocks of S·C·N contiguous elements (one per window row), so
  every GEMM operand is a strided view of the tensor and no patch is ever gathered. A batch
  slice `xp[..., n0:n1]` or a spatial slice `xp[h0:h1, w0:w1]` is still a valid operand.
- weights and their gradients: (P, R, Q, K, S, C), with P = Q = 1 when tied. Each (output
  position p, q; window row r) block wp[p, r, q] is one contiguous K×(S·C) matrix, the exact
  operand of the kernels' per-row GEMMs (see `filter_packed`), and the blocks of one output row
  p and window row r follow each other along q, the order in which backward-data, which walks
  input rows, reads them. A piece of output rows `wp[p0:p1]` is contiguous; a piece of output
  columns `wp[:, :, q0:q1]` or of output channels `wp[:, :, :, k0:k1]` is a strided view that
  the kernels read in place. Measured at the seed L1 shape (batch 64, untied, the same kernels
  on three orders of the same blocks): against (P, Q, K, R, S, C), whose blocks are strided
  column blocks of a K×(R·S·C) matrix per position, backward-filter runs 11% faster (7% when
  accumulating) and backward-data 7%; against (P, Q, R, K, S, C), whose consecutive blocks
  along q lie R·K·S·C apart, backward-data runs 20% faster; forward is within 2% on all three.

An executor should pack each weight once when the run starts, keep it packed for the whole run
(optimizer updates are elementwise, hence indifferent to the layout; a sparse update of input
channels lo:hi is `wp[..., lo:hi] -= lr * dwp`), and unpack only for checkpoints and exports.
A layer's (P, Q, K, N) output is the next layer's (H, W, C, N) input, so activations could flow
from one packed kernel to the next; the executor converts them at each filter task instead
(`runtime/adapters/windowed.py`), since the layers between filters read the logical layout:
about 130 MB a step of seed-lcn at batch 64, which `_convert` moves through tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import prange

from runtime.aligned import aligned_empty
from runtime.kernels import _checks
from runtime.kernels.geometry import check_ndim
from runtime.kernels.threaded import threaded

#: packed weight axis i holds axis WEIGHT_AXES[i] of the logical (K, 1, 1, C, R, S, P, Q)
WEIGHT_AXES = (6, 4, 7, 0, 5, 3)
# the logical order of (*packed axes, the two unit axes), and back
_PACK = (*WEIGHT_AXES, 1, 2)
_UNPACK = tuple(int(i) for i in np.argsort(_PACK))


def _placed_copy(view: np.ndarray, large: bool, compiled: Callable[[np.ndarray], None],
                 out: np.ndarray | None = None):  # fmt: skip
    """A C-contiguous copy of the transposed `view`, placed on a cache line (`runtime.aligned`:
    NumPy starts a large array 16 bytes into one, which splits every vector access of a row),
    or written into `out` (C-contiguous, of the view's shape and dtype: a step's buffer, which
    the result then need not be copied into): by NumPy for small arrays, by `compiled(out)`
    for `large` ones."""
    if out is None:
        out = aligned_empty(view.shape, view.dtype)
    else:
        _checks.output("out", out, view.shape, "the converted array", view)
    if large:
        compiled(out)
    else:
        out[...] = view
    return out


def pack_activations(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> a C-contiguous (H, W, C, N) copy."""
    check_ndim("x", x, 4, "(N, C, H, W)")
    large = x.size >= LARGE_ACTIVATIONS
    return _placed_copy(x.transpose(2, 3, 1, 0), large, lambda xp: _convert(x, xp, True))


def unpack_activations(xp: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(H, W, C, N) -> a C-contiguous (N, C, H, W) copy, or into `out` where given."""
    check_ndim("xp", xp, 4, "(H, W, C, N)")
    large = xp.size >= LARGE_ACTIVATIONS
    return _placed_copy(xp.transpose(3, 2, 0, 1), large, lambda x: _convert(x, xp, False), out)


#: activations of at least this many elements are converted by `_convert`:
#: NumPy's copy of the transposed view ran at 1.3 GB/s on the seed's first layer output (17.8 MB
#: in 13.9 ms one way, 22.9 ms the other, against 0.8 ms for a plain copy), and the filter
#: tasks convert five such tensors a step; small ones convert in microseconds either way
LARGE_ACTIVATIONS = 1 << 20
#: a conversion moves a tile of this many samples by this many columns (a cache line of
#: float32 on the (H, W, C, N) side) at a time
TILE = 16


# A task per input row and block of `TILE` samples; for each channel it moves the row's
# samples × columns through a tile: read where the tile's rows are contiguous in the source,
# written out through the tile's columns, so that both arrays are read and written a vector at
# a time and only the small tile is accessed across. At the seed's L1 input (64 × 64 × 33 × 33
# float32), element by element (the batch innermost, a cache line of it at a time): 6.3 ms
# packing and 8.5 ms unpacking; through tiles 3.9 and 3.6 ms; at 66 × 66 rows of 32 channels
# 11.8 and 17.6 → 8.4 and 5.9 ms.
@threaded
def _convert(x, xp, packing):
    """Between activations x (N, C, H, W) and xp (H, W, C, N): into xp where `packing`, else
    into x."""
    n_n, c_n, h_n, w_n = x.shape
    blocks = (n_n + TILE - 1) // TILE
    for hb in prange(h_n * blocks):
        h, n0 = hb // blocks, hb % blocks * TILE
        nt = min(n_n - n0, TILE)
        tile = np.empty((TILE, TILE), x.dtype)
        for c in range(c_n):
            for w0 in range(0, w_n, TILE):
                wt = min(w_n - w0, TILE)
                if packing and nt == TILE and wt == TILE:
                    for a in range(TILE):
                        for j in range(TILE):
                            tile[a, j] = x[n0 + a, c, h, w0 + j]
                    for j in range(TILE):
                        for a in range(TILE):
                            xp[h, w0 + j, c, n0 + a] = tile[a, j]
                elif nt == TILE and wt == TILE:
                    for j in range(TILE):
                        for a in range(TILE):
                            tile[j, a] = xp[h, w0 + j, c, n0 + a]
                    for a in range(TILE):
                        for j in range(TILE):
                            x[n0 + a, c, h, w0 + j] = tile[j, a]
                elif packing:  # an edge tile, element by element
                    for j in range(wt):
                        for a in range(nt):
                            xp[h, w0 + j, c, n0 + a] = x[n0 + a, c, h, w0 + j]
                else:
                    for a in range(nt):
                        for j in range(wt):
                            x[n0 + a, c, h, w0 + j] = xp[h, w0 + j, c, n0 + a]


#: weights of at least this many elements are converted by `_pack` and `_unpack`: NumPy's copy
#: of an 8-D transposed view runs 4× slower on the seed's L1 weights (1.4 s against 0.34 s for
#: 585 MB on one thread), while small ones convert in microseconds either way and need no
#: compiled kernel
LARGE_WEIGHTS = 1 << 22


def pack_weights(w: np.ndarray) -> np.ndarray:
    """(K, 1, 1, C, R, S, P, Q) -> a C-contiguous (P, R, Q, K, S, C) copy."""
    check_ndim("w", w, 8, "(K, 1, 1, C, R, S, P, Q)")
    if w.shape[1:3] != (1, 1):
        raise ValueError(f"w: axes 1 and 2 must be unit axes, got shape {w.shape}")
    large = w.size >= LARGE_WEIGHTS
    return _placed_copy(w.transpose(_PACK)[..., 0, 0], large, lambda wp: _pack(w[:, 0, 0], wp))


def unpack_weights(wp: np.ndarray) -> np.ndarray:
    """(P, R, Q, K, S, C) -> a C-contiguous (K, 1, 1, C, R, S, P, Q) copy."""
    check_ndim("wp", wp, 6, "(P, R, Q, K, S, C)")
    large = wp.size >= LARGE_WEIGHTS
    view = wp[..., None, None].transpose(_UNPACK)
    return _placed_copy(view, large, lambda w: _unpack(wp, w[:, 0, 0]))


# Both transposes walk one (k, r, s) at a time, and within it every (p, q) over all c: the c
# elements of one (p, q) are contiguous in the packed layout and lie on c pages of the logical
# one, the same c pages for every (p, q) of the tile, which stay in the TLB and the cache.
@threaded
def _pack(w, wp):
    k_n, c_n, r_n, s_n, p_n, q_n = w.shape
    for k in prange(k_n):
        for r in range(r_n):
            for s in range(s_n):
                for p in range(p_n):
                    for q in range(q_n):
                        for c in range(c_n):
                            wp[p, r, q, k, s, c] = w[k, c, r, s, p, q]


@threaded
def _unpack(wp, w):
    k_n, c_n, r_n, s_n, p_n, q_n = w.shape
    for k in prange(k_n):
        for r in range(r_n):
            for s in range(s_n):
                for p in range(p_n):
                    for q in range(q_n):
                        for c in range(c_n):
                            w[k, c, r, s, p, q] = wp[p, r, q, k, s, c]


def canonical_unit_strides(a: np.ndarray) -> np.ndarray:
    """`a` with each length-1 axis given the stride a C-contiguous array would give it (NumPy
    leaves such strides arbitrary), so that a kernel may read leading dimensions off them."""
    strides = list(a.strides)
    for axis in range(a.ndim - 1, -1, -1):
        if a.shape[axis] == 1:
            inner = axis + 1
            strides[axis] = a.itemsize if inner == a.ndim else strides[inner] * a.shape[inner]
    if tuple(strides) == a.strides:
        return a
    return np.lib.stride_tricks.as_strided(a, a.shape, tuple(strides), writeable=a.flags.writeable)
