"""The local executor: runs a task graph's tasks in program order on one process.

It is a thin adapter over the shared per-piece step (`run_task_piece`): it owns one NumPy array per
tensor, in the logical layout, and hands each task the views of its requirements' rects. The MPI
executor runs the same step on a rank's pieces with buffers of its own.

Parameters and optimizer state (resident tensors) live across steps and across graphs: a training
run lowers one graph per batch size it meets (the last, partial batch of an epoch; evaluation
batches), and all of them share the parameters by name. Activations and gradients are
reallocated only when a graph needs other dims.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from legion_nn.access import piece_requirements
from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from runtime.adapters import StepContext, run_piece
from runtime.aligned import aligned_copy, aligned_zeros
from runtime.instances import Layout, choose_layouts
from runtime.kernels.blas import kernel_threading

NUMPY_DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64}


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
) -> None:
    """Run one piece of a task: views in, kernel, results written or reduced into the views.

    `view(tensor_name, rect)` returns a writable array for that rect of the tensor.
    """
    requirements = piece_requirements(task, tensors, piece)
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
    """The kernel of a piece on given views; a `write` view is overwritten, a `reduce` one added to.

    The rank executor hands a piece's reductions zeroed scratch views where the sums must be split
    between ranks, so what accumulates there is exactly the piece's contribution."""
    requirements = tuple(requirements)
    dims = {req.role: tensors[req.tensor].dims for req in requirements}
    results = run_piece(task, piece, views, dims, ctx)
    for req in requirements:
        if req.role not in results:
            continue
        target = views[req.role]
        if req.privilege is Privilege.REDUCE:
            target += results[req.role]
        elif req.privilege is Privilege.WRITE:
            target[...] = results[req.role]
        else:
            raise AssertionError(f"{task.name}: adapter returned a {req.privilege} role {req.role}")


class LocalExecutor:
    """One process, every tensor whole. `rank 0 of 1` for the training loop."""

    is_root = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        #: physical arrays by tensor name, in the layout of `layouts[name]`
        self.arrays: dict[str, np.ndarray] = {}
        self.layouts: dict[str, Layout] = {}
        self._tensors: dict[str, Tensor] = {}

    def prepare(self, graph: TaskGraph) -> None:
        """Allocate what `graph` needs; resident tensors are initialised once, in name order."""
        layouts = choose_layouts(graph)
        for name in sorted(graph.tensors):
            tensor = graph.tensors[name]
            layout = self.layouts.setdefault(name, layouts[name])
            current = self.arrays.get(name)
            if current is not None and current.shape == layout.shape(tensor.dims):
                continue
            if tensor.kind in ("param", "state"):
                if current is not None:
                    raise ValueError(f"tensor {name} changed dims to {list(tensor.dims)}")
                # Each resident tensor draws from its own stream so that adding a layer does not
                # change the initial values of the others.
                stream = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
                self.arrays[name] = aligned_copy(layout.from_logical(initial_value(tensor, stream)))
            else:
                self.arrays[name] = aligned_zeros(
                    layout.shape(tensor.dims), NUMPY_DTYPES[tensor.dtype]
                )
            self._tensors[name] = tensor

    def view(self, name: str, rect: Rect) -> np.ndarray:
        return self.arrays[name][self.layouts[name].slices(rect)]

    def logical(self, name: str) -> np.ndarray:
        """The tensor in its logical layout (a copy where the instance is packed)."""
        return self.layouts[name].to_logical(self.arrays[name])

    def run(
        self, graph: TaskGraph, ctx: StepContext, tasks: Iterable[Task] | None = None
    ) -> StepContext:
        """Run `tasks` (default: the whole step) of `graph` in program order."""
        self.prepare(graph)
        with kernel_threading():  # once per step, not once per kernel
            for task in graph.tasks if tasks is None else tasks:
                run_task_piece(task, task.space, graph.tensors, self.view, ctx)
        return ctx

    def run_inference(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        """The forward pass alone (see `inference_tasks`)."""
        return self.run(graph, ctx, inference_tasks(graph))

    def value(self, name: str) -> np.ndarray:
        return self.logical(name)

    def gather(self, value):
        return [value]

    def step_extras(self) -> dict:
        return {}

    def resident(self) -> dict[str, np.ndarray]:
        """Parameters and state by name, in their logical layouts: what a checkpoint holds."""
        return {
            name: self.logical(name)
            for name in self.arrays
            if self._tensors[name].kind in ("param", "state")
        }

    def load_resident(self, arrays: dict[str, np.ndarray]) -> None:
        """Set parameters and state from logical arrays (a checkpoint)."""
        for name, array in arrays.items():
            current = self.arrays.get(name)
            tensor = self._tensors.get(name)
            if current is None or tensor is None or tuple(array.shape) != tensor.dims:
                raise ValueError(f"tensor {name} {list(array.shape)} does not fit this network")
            current[...] = self.layouts[name].from_logical(array)


def inference_tasks(graph: TaskGraph) -> list[Task]:
    """The forward pass alone: forward tasks and the zeroing of the statistics they reduce into."""
    return [
        task
        for task in graph.tasks
        if task.phase == "forward"
        or (task.phase == "set_zero" and graph.tensors[task.requirements[0].tensor].kind != "grad")
    ]
