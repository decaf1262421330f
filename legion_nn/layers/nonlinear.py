"""`filterNL`: an elementwise nonlinearity (relu, tanh, sigmoid); `relu` is its short spelling.

The backward reads the forward *output*, from which all three derivatives follow
(relu: y > 0, tanh: 1 − y², sigmoid: y(1 − y)), so the input need not be kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from legion_nn.layers.base import ElementwiseLayer, layer_kind, record_elementwise

FUNCTIONS = ("relu", "tanh", "sigmoid")


# relu's compare forward; backward a compare and a select (tanh, sigmoid cost more, uncounted)
record_elementwise("filterNL", forward=1, backward=2)


@layer_kind("filterNL")
@dataclass
class FilterNL(ElementwiseLayer):
    OP_NAME = "filterNL"
    BACKWARD_READS_OUTPUT = True
    fn: str = "relu"

    def __post_init__(self) -> None:
        if self.fn not in FUNCTIONS:
            raise ValueError(f"fn must be one of {', '.join(FUNCTIONS)}, got {self.fn!r}")

    def attrs(self) -> dict[str, Any]:
        return {"fn": self.fn}


@layer_kind("relu")
@dataclass
class Relu(FilterNL):
    def __post_init__(self) -> None:
        if self.fn != "relu":
            raise ValueError(f"a relu layer computes relu; use filterNL for {self.fn!r}")
