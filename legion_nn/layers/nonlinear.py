"""`filterNL`: an elementwise nonlinearity (relu, tanh, sigmoid); `relu` is its short spelling.
`gelu`: the Gaussian error linear unit of transformers, exact or in its tanh approximation.

filterNL's backward reads the forward *output*, from which all three derivatives follow
(relu: y > 0, tanh: 1 − y², sigmoid: y(1 − y)), so the input need not be kept. Gelu's
derivative is no function of its output (it is not monotonic), so its backward reads the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from legion_nn.layers.base import ElementwiseLayer, layer_kind, one_of, record_elementwise

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
        one_of("fn", self.fn, FUNCTIONS)

    def attrs(self) -> dict[str, Any]:
        return {"fn": self.fn}


@layer_kind("relu")
@dataclass
class Relu(FilterNL):
    def __post_init__(self) -> None:
        if self.fn != "relu":
            raise ValueError(f"a relu layer computes relu; use filterNL for {self.fn!r}")


#: PyTorch's `approximate`: the exact erf form, or GPT-2's tanh form
GELU_APPROXIMATIONS = ("none", "tanh")

# per element, counting erf, tanh and exp as the ~20 FLOPs of their polynomial evaluations:
# the forward one of them and four more; the backward one or two and about ten more
record_elementwise("gelu", forward=25, backward=45)


@layer_kind("gelu")
@dataclass
class Gelu(ElementwiseLayer):
    OP_NAME = "gelu"
    BACKWARD_READS_INPUT = True
    approximate: str = "none"

    def __post_init__(self) -> None:
        one_of("approximate", self.approximate, GELU_APPROXIMATIONS)

    def attrs(self) -> dict[str, Any]:
        return {"approximate": self.approximate}
