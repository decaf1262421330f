"""The adapter registry: `adapter(op, phase)` registers how a task's piece runs; `run_piece` runs it.

See `runtime.adapters` for the contract between adapters, views and privileges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from legion_nn.ir import Task
from legion_nn.rect import Rect


@dataclass
class StepContext:
    """What a step's tasks need besides tensors: its number, its batch, and returned values."""

    step: int
    #: False for evaluation: dropout passes its input through, batchnorm uses running statistics
    training: bool = True
    inputs: np.ndarray | None = None
    labels: np.ndarray | None = None
    futures: dict[str, Any] = field(default_factory=dict)


Views = Mapping[str, np.ndarray]
Dims = Mapping[str, tuple[int, ...]]
Adapter = Callable[[Task, Rect, Views, Dims, StepContext], dict[str, np.ndarray]]
ADAPTERS: dict[tuple[str, str], Adapter] = {}


def adapter(op: str, phase: str):
    def wrap(fn: Adapter) -> Adapter:
        ADAPTERS[(op, phase)] = fn
        return fn

    return wrap


def run_piece(task: Task, piece: Rect, views: Views, dims: Dims, ctx: StepContext) -> dict:
    try:
        fn = ADAPTERS[(task.op, task.phase)]
    except KeyError:
        raise NotImplementedError(f"no kernel for op {task.op!r} in phase {task.phase!r}") from None
    return fn(task, piece, views, dims, ctx)
