"""`dropout`: inverted dropout whose mask is a hash of (seed, step, global element index).

No mask tensor exists: forward and backward recompute it, and because it depends on an element's
global index rather than on which rank holds it, every partition draws the same mask as the
single-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from legion_nn.layers.base import ElementwiseLayer, layer_kind, record_elementwise

# forward hashes the mask and scales, backward scales
record_elementwise("dropout", forward=2, backward=1)


@layer_kind("dropout")
@dataclass
class Dropout(ElementwiseLayer):
    ratio: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise TypeError(f"ratio must be a number in [0, 1), got {self.ratio!r}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio!r}")

    def attrs(self) -> dict[str, Any]:
        return {"ratio": float(self.ratio), "seed": int(self.seed)}
