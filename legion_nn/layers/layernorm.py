"""`layernorm`: every token's features normalised, y = (x − mean)/√(var + eps)·gamma + beta.

The statistics are a token's own (over its D features), so a piece must hold whole tokens: the
task splits over the batch and the positions (data and sequence parallelism, as Megatron's
sequence-parallel LayerNorm), never over the features. A piece reads all of `gamma` and `beta`,
and its backward reduces into their gradients; it recomputes the statistics from its input rather
than keeping them, which costs two passes over a piece it reads anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn.layers.base import Layer, Shape, layer_kind, record_grid_op, sequence_axes
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _layernorm_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    features = Rect.empty(1) if piece.is_empty() else Rect((0,), (attrs["features"],))
    return {
        "input": piece,
        "output": piece,
        "output.delta": piece,
        "input.delta": piece,
        "gamma": features,
        "beta": features,
        "gamma.delta": features,
        "beta.delta": features,
    }


# forward: mean, variance, normalise, scale and shift; backward: the statistics again, the two
# sums and the input gradient
record_grid_op("layernorm", _layernorm_rects, {"forward": 8, "backward": 14}, splittable=(0, 1))


@layer_kind("layernorm")
@dataclass
class LayerNorm(Layer):
    """PyTorch's `nn.LayerNorm(D)` (ONNX LayerNormalization over the last axis)."""

    RANKS = (2,)

    eps: float = 1e-5

    def __post_init__(self) -> None:
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or self.eps <= 0:
            raise ValueError(f"eps must be a positive number, got {self.eps!r}")

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        features = shape[-1]
        gamma = ctx.param(f"{self.name}.gamma", (features,), "const:1.0")
        beta = ctx.param(f"{self.name}.beta", (features,), "zeros")
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"features": features, "eps": float(self.eps), **sequence_axes(shape)}
        reads = [("input", x, R_), ("gamma", gamma, R_)]
        bindings = reads + [("beta", beta, R_), ("output", y, W_)]
        ctx.task(self.stem, "layernorm", "forward", space, bindings, self.name, attrs)

        def backward() -> None:
            bindings = [("output.delta", ctx.grad(y), R_)] + reads
            if ctx.needs_grad(x):
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings += [("gamma.delta", ctx.grad(gamma), RD), ("beta.delta", ctx.grad(beta), RD)]
            ctx.task(
                f"{self.stem}.grad", "layernorm", "backward", space, bindings, self.name, attrs
            )
            ctx.update(gamma, f"update_{self.name}.gamma", self.name)
            ctx.update(beta, f"update_{self.name}.beta", self.name)

        ctx.on_backward(backward)
        return y
