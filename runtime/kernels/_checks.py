"""Argument checks shared by the op kernels.

Kernels are called by the executor on pieces it cut itself, so a bad argument is a bug upstream;
the checks turn it into a one-line ValueError that names the argument and the shapes involved
instead of an out-of-bounds write inside a Numba loop (TypeError when it is not an array at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def floating(name: str, a: np.ndarray, ndim: int | None = None) -> None:
    """Require a float32/float64 ndarray, optionally of a given rank."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype not in FLOATS:
        raise ValueError(f"{name} must be float32 or float64, got {a.dtype} with shape {a.shape}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {a.shape}")


def four_d(name: str, a: np.ndarray) -> np.ndarray:
    """A float array of rank 1 to 4 as a 4-d view (unit axes in front), for the elementwise
    kernels' loops: a sequence's (N, T, D) runs as (1, N, T, D)."""
    floating(name, a)
    if not 1 <= a.ndim <= 4:
        raise ValueError(f"{name} must be 1-d to 4-d, got shape {a.shape}")
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def same_dtype(name: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    if a.dtype != ref.dtype:
        raise ValueError(
            f"{name} dtype {a.dtype} {a.shape} differs from {ref_name} dtype {ref.dtype} {ref.shape}"
        )


def code(name: str, value: str, codes: Mapping[str, int]) -> int:
    """The integer a Numba kernel takes for `value`, one of `codes`' names."""
    if value not in codes:
        raise ValueError(f"{name} must be one of {sorted(codes)}, got {value!r}")
    return codes[value]


def like(name: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    """Require a float array of `ref`'s shape and dtype (an elementwise op's second operand)."""
    floating(name, a)
    shape(name, a, ref.shape)
    same_dtype(name, a, ref_name, ref)


def shape(name: str, a: np.ndarray, expected: Sequence[int]) -> None:
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {a.shape}")


def output(
    name: str, out: np.ndarray, expected: Sequence[int], ref_name: str, ref: np.ndarray
) -> np.ndarray:
    """Require an array a kernel writes its result into, in place: of `expected` shape, in
    `ref`'s dtype, C-contiguous; return it."""
    shape(name, out, expected)
    same_dtype(name, out, ref_name, ref)
    c_contiguous(name, out)
    return out


def output_or_new(
    out: np.ndarray | None, expected: Sequence[int], ref_name: str, ref: np.ndarray
) -> np.ndarray:
    """The array a kernel writes its result into: `out` as `output` requires it (named "out"),
    or, where none is given, a new one of `expected` shape in `ref`'s dtype."""
    if out is None:
        return np.empty(expected, ref.dtype)
    return output("out", out, expected, ref_name, ref)


def c_contiguous(name: str, a: np.ndarray, why: str = "") -> None:
    """Require a C-contiguous array (an output a product writes or adds into in place)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous{why}, got strides {a.strides}")


def labels(name: str, lab: np.ndarray, n: int, classes: int) -> None:
    """Require int32 labels of shape (n, 1, 1, 1) with values in [0, classes)."""
    if not isinstance(lab, np.ndarray) or lab.dtype != np.int32:
        got = lab.dtype if isinstance(lab, np.ndarray) else type(lab).__name__
        raise ValueError(f"{name} must be an int32 array, got {got}")
    shape(name, lab, (n, 1, 1, 1))
    if n and (lab.min() < 0 or lab.max() >= classes):
        raise ValueError(f"{name} must lie in [0, {classes}), got range [{lab.min()}, {lab.max()}]")


def pair(name: str, value: int | Sequence[int]) -> tuple[int, int]:
    """An int or a pair of ints as (rows, cols)."""
    vals = (value, value) if np.isscalar(value) else tuple(value)
    if len(vals) != 2 or any(int(v) != v for v in vals):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return int(vals[0]), int(vals[1])
