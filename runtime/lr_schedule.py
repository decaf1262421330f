"""Learning-rate schedules: the factor on the optimizer's learning rate at each training step.

At step t (from 0) of S, after a linear warm-up over the first W steps, factor (t+1)/W:

- `constant`: 1;
- `cosine`: ½(1 + cos(π(t−W)/(S−W))), PyTorch's cosine annealing to zero, as a `LambdaLR`;
- `step`: γ^⌊(t−W)/step_size⌋, PyTorch's `StepLR` counted from the end of the warm-up.

The factor is a function of the step alone, so a run resumed from a checkpoint at step t continues
the schedule exactly where it stood.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from legion_nn.errors import LegionNNError

SCHEDULES = ("constant", "cosine", "step")


@dataclass(frozen=True)
class LRSchedule:
    kind: str = "constant"
    warmup_steps: int = 0
    #: `step`: steps between decays, and the factor of each
    step_size: int | None = None
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise LegionNNError(
                f"--lr-schedule: unknown schedule {self.kind!r}; choose one of "
                f"{', '.join(SCHEDULES)}"
            )
        if self.warmup_steps < 0:
            raise LegionNNError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.kind == "step" and self.step_size is None:
            raise LegionNNError("--lr-schedule step needs --step-size N")
        if self.step_size is not None and self.step_size < 1:
            raise LegionNNError(f"--step-size must be at least 1, got {self.step_size}")
        if not self.gamma > 0:
            raise LegionNNError(f"--gamma must be positive, got {self.gamma}")

    def factor(self, step: int, total_steps: int) -> float:
        """The learning rate's factor at `step` (from 0) of a run of `total_steps`."""
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))
        if self.kind == "step":
            return self.gamma ** ((step - warmup) // self.step_size)
        return 1.0
