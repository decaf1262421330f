"""The parts of multi-head attention: heads split and merged, batched products of two
activations, and the softmax of every row of scores, causal or not.

A block's attention is written with them as PyTorch writes it::

    q, k, v = Dense(...), Dense(...), Dense(...)          # (T, D) each
    SplitHeads(heads=H) on each                           # (H, T, D/H)
    MatMul(inputs=[q, k], transpose_b=True, scale=1/√Dh)  # scores (H, T, T)
    RowSoftmax(causal=True)                               # probabilities
    MatMul(inputs=[p, v])                                 # context (H, T, Dh)
    MergeHeads()                                          # (T, D)

Heads are (N, H, T, Dh). Their tasks name the roles of their dims (`axes`): the heads are what
`model` splits (Megatron's attention split by heads), the query positions what `spatial` splits.
A head's features (Dh) and a row of scores are never cut, except a product's summed dim, which a
grid may cut like any reduction (`partitioner.reduction_split`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn.errors import ShapeError
from legion_nn.layers.base import (
    COPY,
    ElementwiseLayer,
    Layer,
    Shape,
    layer_kind,
    moving_tasks,
    positive,
    record_grid_op,
)
from legion_nn.layers.merge import input_role
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE
#: the dims of heads (N, H, T, Dh): the heads are features, the positions positions
HEAD_AXES = "NFS-"


# Features sliced: output (N, T, stop − start) = input (N, T, D)[..., start:stop]


def _slice_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    features = piece.translate((0, 0, attrs["start"])) if not piece.is_empty() else piece
    return {"input": features, "input.delta": features, "output": piece, "output.delta": piece}


record_grid_op("slice", _slice_rects, COPY)


@layer_kind("slice")
@dataclass
class FeatureSlice(Layer):
    """Features [start, stop) of every token (ONNX Split of a fused Q, K, V projection)."""

    RANKS = (2,)

    start: int = 0
    stop: int = 1

    def out_shape(self, shape: Shape) -> Shape:
        if not 0 <= self.start < self.stop <= shape[1]:
            raise ShapeError(
                f"{self.label}: features [{self.start}, {self.stop}) of {shape[1]} do not fit"
            )
        return (shape[0], self.stop - self.start)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + self.out_shape(shape)
        return moving_tasks(self, ctx, x, dims, "slice", {"start": self.start, "axes": "NSF"})


# Heads split: output (N, H, T, Dh) from input (N, T, H·Dh)


def _split_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        features = Rect.empty(3)
    else:
        (n0, h0, t0, _), (n1, h1, t1, _) = piece.lo, piece.hi
        size = attrs["head_size"]
        features = Rect((n0, t0, h0 * size), (n1, t1, h1 * size))
    return {"input": features, "input.delta": features, "output": piece, "output.delta": piece}


# a copy per element both ways
record_grid_op("split_heads", _split_rects, COPY, (0, 1, 2))


@layer_kind("split_heads")
@dataclass
class SplitHeads(Layer):
    """(T, D) as `heads` heads of D/heads features, (H, T, D/H): view and transpose."""

    RANKS = (2,)

    heads: int = 1

    def __post_init__(self) -> None:
        positive(self.heads, "heads")

    def out_shape(self, shape: Shape) -> Shape:
        tokens, features = shape
        if features % self.heads:
            raise ShapeError(
                f"{self.label}: {features} features do not split into {self.heads} heads"
            )
        return (self.heads, tokens, features // self.heads)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        heads, tokens, size = self.out_shape(shape)
        return _reshaping(self, ctx, x, (ctx.batch, heads, tokens, size), "split_heads", size)


# Heads merged: output (N, T, H·Dh) from input (N, H, T, Dh)


def _merge_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """The heads a piece's features fall in, whole: exact where its cut lies between heads."""
    if piece.is_empty():
        heads = Rect.empty(4)
    else:
        (n0, t0, c0), (n1, t1, c1) = piece.lo, piece.hi
        size = attrs["head_size"]
        heads = Rect((n0, c0 // size, t0, 0), (n1, -(-c1 // size), t1, size))
    return {"input": heads, "input.delta": heads, "output": piece, "output.delta": piece}


record_grid_op("merge_heads", _merge_rects, COPY, (0, 1, 2))


@layer_kind("merge_heads")
@dataclass
class MergeHeads(Layer):
    """(H, T, Dh) back to (T, H·Dh): transpose and view."""

    RANKS = (3,)
    TAKES = "heads [H, T, Dh]"

    def out_shape(self, shape: Shape) -> Shape:
        heads, tokens, size = shape
        return (tokens, heads * size)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        tokens, features = self.out_shape(shape)
        return _reshaping(self, ctx, x, (ctx.batch, tokens, features), "merge_heads", shape[2])


def _reshaping(layer: Layer, ctx, x: str, dims: tuple, op: str, head_size: int) -> str:
    attrs = {"head_size": head_size, "axes": HEAD_AXES if len(dims) == 4 else "NSF"}
    return moving_tasks(layer, ctx, x, dims, op, attrs)


# Batched products of two activations: out (N, H, I, J) = scale · a (N, H, I, K) · b', where b'
# is b (N, H, K, J), or bᵀ for b (N, H, J, K) (`transpose_b`); the space is (N, H, I, J, K)


def _matmul_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        a = b = out = Rect.empty(4)
    else:
        (n0, h0, i0, j0, k0), (n1, h1, i1, j1, k1) = piece.lo, piece.hi
        a = Rect((n0, h0, i0, k0), (n1, h1, i1, k1))
        if attrs["transpose_b"]:
            b = Rect((n0, h0, j0, k0), (n1, h1, j1, k1))
        else:
            b = Rect((n0, h0, k0, j0), (n1, h1, k1, j1))
        out = Rect((n0, h0, i0, j0), (n1, h1, i1, j1))
    a_role, b_role = input_role(0), input_role(1)
    return {
        a_role: a,
        b_role: b,
        f"{a_role}.delta": a,
        f"{b_role}.delta": b,
        "output": out,
        "output.delta": out,
    }


# a multiply-add per (output, summed) pair forward; backward both inputs' gradients
record_grid_op("matmul", _matmul_rects, {"forward": 2, "backward": 4}, sums_over=1)


@layer_kind("matmul")
@dataclass
class MatMul(Layer):
    """The product of two activations per head, `scale`·a·b (bᵀ with `transpose_b`): attention's
    scores Q·Kᵀ/√Dh and context P·V (ONNX MatMul of two activations)."""

    MERGES = True
    RANKS = (3,)
    TAKES = "heads [H, T, Dh]"

    transpose_b: bool = False
    scale: float = 1.0

    def out_shape(self, shape: tuple[Shape, ...]) -> Shape:
        if len(shape) != 2:
            raise ShapeError(f"{self.label}: multiplies two inputs, got {len(shape)}")
        (ha, i, k), (hb, *b) = shape
        j, kb = (b[0], b[1]) if self.transpose_b else (b[1], b[0])
        if ha != hb or k != kb:
            raise ShapeError(
                f"{self.label}: cannot multiply {list(shape[0])} by "
                f"{list(shape[1])}{'ᵀ' if self.transpose_b else ''}"
            )
        return (ha, i, j)

    def lower(self, ctx, x: tuple[str, ...], shape: tuple[Shape, ...]) -> str:
        heads, rows, columns = self.out_shape(shape)
        summed = shape[0][2]
        dims = (ctx.batch, heads, rows, columns)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims + (summed,))
        attrs = {"transpose_b": bool(self.transpose_b), "scale": float(self.scale), "axes": "NFS--"}
        reads = [(input_role(i), t, R_) for i, t in enumerate(x)]
        result = Rect.from_dims(dims)
        ctx.task(
            self.stem, "matmul", "forward", space, reads + [("output", y, W_)], self.name, attrs,
            result=result,
        )  # fmt: skip

        def backward() -> None:
            grads = [
                (f"{role}.delta", ctx.grad(t), RD) for role, t, _ in reads if ctx.needs_grad(t)
            ]
            if grads:
                bindings = [("output.delta", ctx.grad(y), R_)] + reads + grads
                ctx.task(
                    f"{self.stem}.grad", "matmul", "backward", space, bindings, self.name, attrs,
                    result=result,
                )  # fmt: skip

        ctx.on_backward(backward)
        return y


# The softmax of every row of scores (N, H, I, J), over J; causal: J beyond I is masked out


def _rows_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {role: piece for role in ("input", "output", "output.delta", "input.delta")}


# max, exp, sum and divide per element; backward a product, a sum and a multiply-add
record_grid_op("row_softmax", _rows_rects, {"forward": 4, "backward": 4}, (0, 1, 2))


@layer_kind("row_softmax")
@dataclass
class RowSoftmax(ElementwiseLayer):
    """Probabilities over the last dim of scores (H, I, J) (ONNX Softmax on the last axis); with
    `causal`, position i attends to positions j ≤ i only (the Where of a causal mask)."""

    RANKS = (3,)
    TAKES = "heads [H, T, Dh]"
    BACKWARD_READS_OUTPUT = True

    causal: bool = False

    def out_shape(self, shape: Shape) -> Shape:
        if self.causal and shape[1] != shape[2]:
            raise ShapeError(
                f"{self.label}: a causal mask needs square scores, got {shape[1]}×{shape[2]}"
            )
        return shape

    def attrs(self) -> dict[str, Any]:
        return {"causal": bool(self.causal), "axes": HEAD_AXES}
