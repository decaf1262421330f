"""The executor's interface (`Executor`, what the training loop relies on) and what running a
task graph needs: initial values, a piece's kernel on views of its requirements, and the forward
pass's tasks.

The one executor is `runtime.rank_executor.RankExecutor`: a rank's share of a plan, over a
transport. A run in one process is a one-rank run of it over an in-process transport
(`runtime.rank_executor.one_process`), so there is one executor to keep right. Parameters and
optimizer state (resident tensors) draw their initial values from a stream per tensor name
(`initial_part`), so every rank count starts from the same values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.op_records import piece_requirements
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.reduction_split import as_partial_sums
from runtime.adapters import StepContext, run_piece

NUMPY_DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64}


class Executor(Protocol):
    """What `runtime.training.Trainer` needs of an executor: run steps of the graphs it lowers,
    read small results, and take part in gathering log records and checkpoints.

    Collective calls (`run`, `run_inference`, `gather`, `resident`) are made by every rank in the
    same order; values that live on one rank come back on rank 0 (`is_root`) and None elsewhere.
    """

    @property
    def is_root(self) -> bool: ...

    def prepare(self, graph: TaskGraph) -> object:
        """Plan `graph` and allocate what it needs (resident tensors once, for the whole run)."""

    def run(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        """One training step of `graph`: forward, zeroing, backward and updates."""

    def run_inference(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        """The forward pass of `graph` alone (`inference_tasks`)."""

    def value(self, name: str) -> np.ndarray | None:
        """A whole small tensor (the loss, evaluate's sums) where it is held, else None."""

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value`, in rank order, on rank 0."""

    def step_extras(self) -> dict[str, Any]:
        """What the last step's log record adds: bytes sent and planned, the runtime's buffer
        peak (`buffer_peak_bytes`) and the process's peak resident set (`rss_peak_bytes`)."""

    def resident(self) -> dict[str, np.ndarray] | None:
        """Parameters and state, whole and logical, on rank 0: what a checkpoint holds."""

    def load_resident(self, arrays: dict[str, np.ndarray]) -> None:
        """Set parameters and state from whole logical arrays (a checkpoint)."""


def initial_value(tensor: Tensor, rng: np.random.Generator) -> np.ndarray:
    """A resident tensor's first value, from its `init` spec."""
    dtype = NUMPY_DTYPES[tensor.dtype]
    kind, _, arg = tensor.init.partition(":")
    if kind in ("", "zeros"):
        return np.zeros(tensor.dims, dtype)
    if kind == "const":
        return np.full(tensor.dims, float(arg), dtype)
    if kind == "normal":
        return (rng.standard_normal(tensor.dims) * float(arg)).astype(dtype)
    if kind == "rows":  # one constant per index of the first axis, e.g. running [mean, var]
        values = np.array([float(v) for v in arg.split(",")], dtype)
        return np.broadcast_to(
            values.reshape((-1,) + (1,) * (len(tensor.dims) - 1)), tensor.dims
        ).copy()
    if kind == "he":
        return (rng.standard_normal(tensor.dims) * np.sqrt(2.0 / float(arg))).astype(dtype)
    raise ValueError(f"tensor {tensor.name}: unknown init {tensor.init!r}")


def initial_part(tensor: Tensor, rng: np.random.Generator, box: Rect) -> np.ndarray:
    """`initial_value(tensor, rng)[box]`, without holding the whole tensor at once.

    Random inits draw the whole stream in order (so every rank's part agrees with the local
    run's tensor) but a block of first-axis slices at a time, keeping only what lies in `box`:
    seed-lcn's untied weights are 585 MB in float32 and 1.2 GB as drawn."""
    kind = tensor.init.partition(":")[0]
    if kind not in ("normal", "he") or not tensor.dims:
        return np.ascontiguousarray(initial_value(tensor, rng)[box.to_slices()])
    dims = tensor.dims
    per_row = max(1, int(np.prod(dims[1:], dtype=np.int64)))
    block = max(1, (1 << 22) // per_row)  # about 32 MB of float64 draws at a time
    out = np.empty(box.shape, NUMPY_DTYPES[tensor.dtype])
    inner = box.to_slices()[1:]
    for start in range(0, box.hi[0], block):
        stop = min(start + block, dims[0])
        shaped = replace(tensor, dims=(stop - start, *dims[1:]))
        drawn = initial_value(shaped, rng)
        lo, hi = max(start, box.lo[0]), min(stop, box.hi[0])
        if lo < hi:
            out[lo - box.lo[0] : hi - box.lo[0]] = drawn[(slice(lo - start, hi - start), *inner)]
    return out


def run_task_piece(
    task: Task,
    piece: Rect,
    tensors: dict[str, Tensor],
    view,
    ctx: StepContext,
    partial: bool = False,
) -> None:
    """Run one piece of a task: views in, kernel, results written or reduced into the views.

    `view(tensor_name, rect)` returns a writable array for that rect of the tensor. A `partial`
    piece covers part of a dim the task sums over: its writes are partial sums, added into
    their views (which the caller zeroed)."""
    requirements = piece_requirements(task, tensors, piece)
    if partial:
        requirements = as_partial_sums(requirements)
    views = {req.role: view(req.tensor, req.rect) for req in requirements}
    run_on_views(task, piece, requirements, views, tensors, ctx)


def run_on_views(
    task: Task,
    piece: Rect,
    requirements: Iterable[Requirement],
    views: dict[str, np.ndarray],
    tensors: dict[str, Tensor],
    ctx: StepContext,
) -> None:
    """The kernel of a piece on given views; a `write` view is overwritten, a `reduce` one added to
    (or overwritten, where `ctx.fresh` names it: the first contribution since an elided zeroing).

    The rank executor hands a piece's reductions zeroed scratch views where the sums must be split
    between ranks, so what accumulates there is exactly the piece's contribution. A role whose
    rect the piece does not touch gets no view: a bias, which only the piece starting a sum over
    a reduction dim adds, or a sparse update's channels outside the piece's."""
    requirements = tuple(requirements)
    dims = {req.role: tensors[req.tensor].dims for req in requirements}
    views = {role: view for role, view in views.items() if view.size}
    results = run_piece(task, piece, views, dims, ctx)
    for req in requirements:
        if req.role not in results:
            continue
        if req.role not in views:
            raise AssertionError(f"{task.name}: adapter returned role {req.role} it has no view of")
        target = views[req.role]
        if req.privilege is Privilege.REDUCE and req.role not in ctx.fresh:
            target += results[req.role]
        elif req.privilege is Privilege.REDUCE or req.privilege is Privilege.WRITE:
            target[...] = results[req.role]
        else:
            raise AssertionError(f"{task.name}: adapter returned a {req.privilege} role {req.role}")


def inference_tasks(graph: TaskGraph) -> list[Task]:
    """The forward pass alone: forward tasks and the zeroing of the statistics they reduce into."""
    return [
        task
        for task in graph.tasks
        if task.phase == "forward"
        or (task.phase == "set_zero" and graph.tensors[task.requirements[0].tensor].kind != "grad")
    ]
