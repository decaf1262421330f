"""What a run compiles before its first step (`runtime.compile_ahead`), unit by unit.

Numba compiles a kernel the first time it is called with new argument types, in the calling
process and one at a time (a process-wide lock), and then keeps it in its on-disk cache. What a
run will call is known before its first step, from the ops of its task graph, its dtype and its
optimizer (`units_of`).

Each *unit* compiles one op's kernels by calling them, through the same wrappers the adapters
use, on arrays of a few elements laid out as a whole-tensor or batch piece is: the same argument
types, hence the same compiled code, which the run then loads from the cache (`warm`; `cached`
says whether it would). A rank with one thread compiles its kernels' plain loops
(`runtime.kernels.threaded`). A piece laid out otherwise (a spatial piece, a non-contiguous
view) gets its own specialisation, compiled when first called, as without compiling ahead.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba
import numpy as np

from runtime.kernels import (
    affine,
    attention,
    batchnorm,
    conv,
    denormals,
    dropout,
    embedding,
    filter_packed,
    gelu,
    layernorm,
    layout,
    linear,
    nonlinear,
    pool,
    softmax,
    update,
)
from runtime.kernels.threaded import ThreadedKernel

if TYPE_CHECKING:  # a helper process imports this module to compile: nothing else
    from legion_nn.graph import TaskGraph
    from runtime.step.rank_program import RankProgram


def _filter_operands(dtype: np.dtype, untied: bool):
    """x (H, W, C, N), weights, the output's gradient (P, Q, K, N), the window and padding."""
    n, c, h, k, r = 2, 2, 4, 2, 3
    xp = layout.pack_activations(np.zeros((n, c, h, h), dtype))
    p = h if untied else 1
    wp = np.zeros((p, r, p, k, r, c), dtype)
    return xp, wp, np.zeros((h, h, k, n), dtype), (r, r), (1, 1, 1, 1)


def _filter(dtype: np.dtype, untied: bool) -> None:
    xp, wp, _, _, pads = _filter_operands(dtype, untied)
    yp = filter_packed.forward_packed(xp, wp, 1, pads)
    layout.unpack_activations(yp)
    filter_packed.backward_data_packed(yp, wp, xp.shape[:2], 1, pads)
    if not untied:  # one example's passes: an output row's positions are the products' rows
        one = np.ascontiguousarray(xp[..., :1])
        filter_packed.forward_packed(one, wp, 1, pads)
        filter_packed.backward_data_packed(
            np.ascontiguousarray(yp[..., :1]), wp, xp.shape[:2], 1, pads
        )


def _filter_gradient(dtype: np.dtype, untied: bool) -> None:
    """The weight gradient stored (a data-parallel run sums it across ranks)."""
    xp, wp, dyp, window, pads = _filter_operands(dtype, untied)
    grad = np.zeros_like(wp)
    filter_packed.backward_filter_packed(dyp, xp, window, 1, pads, untied, None, grad, True)
    if not untied:  # one example's
        one, dy_one = (np.ascontiguousarray(a[..., :1]) for a in (xp, dyp))
        filter_packed.backward_filter_packed(dy_one, one, window, 1, pads, False, None, grad, True)


def _filter_step(dtype: np.dtype) -> None:
    """The weight gradient stepped by the optimizer in the kernel (an update fused in)."""
    xp, wp, dyp, window, pads = _filter_operands(dtype, True)
    step = update.sgd_step(wp, 0.1)
    filter_packed.backward_filter_packed(dyp, xp, window, 1, pads, True, step=step)


def _affine(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 3, 3), dtype)
    a = np.ones(1, dtype)
    y = affine.filterA_forward(x, a, np.zeros((1, 2, 3, 3), dtype))
    affine.filterA_backward(y, x, a, need_dx=True)


def _gelu(dtype: np.dtype) -> None:
    x = np.ones((2, 2, 2, 2), dtype)  # either form runs the one compiled loop
    gelu.gelu_backward(gelu.gelu_forward(x), x)


def _nonlinear(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 3, 3), dtype)
    y = nonlinear.filterNL_forward(x, "tanh")
    nonlinear.filterNL_backward(x, y, "tanh")


def _linear(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 3, 3), dtype)
    w = np.zeros((3, 2, 3, 3), dtype)
    dy = linear.linear_forward(x, w)
    linear.linear_weight_grad_accumulate(dy, x, np.zeros_like(w))
    linear.linear_input_grad(dy, w, x.shape)


def _linear_step(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 3, 3), dtype)
    w = np.zeros((3, 2, 3, 3), dtype)
    linear.linear_weight_grad_step(np.zeros((2, 3, 1, 1), dtype), x, update.sgd_step(w, 0.1))


def _embedding(dtype: np.dtype) -> None:
    ids = np.zeros((2, 3), np.int32)
    embedding.embedding_backward(ids, embedding.embedding_forward(ids, np.zeros((4, 2), dtype)), 4)


def _layernorm(dtype: np.dtype) -> None:
    x = np.ones((2, 3, 4), dtype)
    gamma = np.ones(4, dtype)
    y = layernorm.layernorm_forward(x, gamma, gamma)
    layernorm.layernorm_backward(y, x, gamma)


def _matmul(dtype: np.dtype) -> None:
    a = np.zeros((1, 2, 3, 4), dtype)
    out = attention.matmul_forward(a, a, transpose_b=True)
    attention.matmul_backward(out, a, a, transpose_b=True)


def _row_softmax(dtype: np.dtype) -> None:
    x = np.zeros((1, 2, 3, 3), dtype)
    attention.row_softmax_backward(x, attention.row_softmax_forward(x, True))


def _softmax(dtype: np.dtype) -> None:
    x = np.zeros((2, 3, 1, 1), dtype)
    labels = np.zeros((2, 1, 1, 1), np.int32)
    prob, _ = softmax.softmax_forward(x, labels, 2)
    softmax.softmax_backward(prob, labels, 2)
    softmax.evaluate_forward(prob, labels)


def _maxpool(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 4, 4), dtype)
    y = pool.maxpool_forward(x, (2, 2), 2, (0, 0, 0, 0))
    pool.maxpool_backward(y, x, (2, 2), 2, (0, 0, 0, 0))


def _avgpool(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 4, 4), dtype)
    y = pool.avgpool_forward(x, (2, 2), 2, (0, 0, 0, 0))
    pool.avgpool_backward(y, x.shape, (2, 2), 2, (0, 0, 0, 0))


def _dropout(dtype: np.dtype) -> None:
    x = np.zeros((2, 2, 3, 3), dtype)
    dropout.dropout_forward(x, 0.5, 1, 0, (0, 0, 0, 0), x.shape)
    dropout.dropout_backward(x, 0.5, 1, 0, (0, 0, 0, 0), x.shape)


def _batchnorm(dtype: np.dtype) -> None:
    x = np.ones((2, 2, 3, 3), dtype)
    gamma, beta = np.ones((1, 2, 1, 1), dtype), np.zeros((1, 2, 1, 1), dtype)
    stats = batchnorm.batchnorm_stats(x).astype(dtype)
    count = 18.0
    batchnorm.batchnorm_forward(x, stats, count, gamma, beta, 1e-5)
    dgamma, dbeta = batchnorm.batchnorm_param_backward(x, x, stats, count, 1e-5)
    batchnorm.batchnorm_input_backward(x, x, stats, count, gamma, dgamma, dbeta, 1e-5)
    batchnorm.batchnorm_inference(x, stats, gamma, beta, 1e-5)


def _update(dtype: np.dtype, elements: int) -> None:
    """Every optimizer's update of `elements`: one kernel, which takes the rule as an
    argument; past `update.CHUNK` elements, its parallel loop."""
    p, g, s1, s2 = (np.zeros(elements, dtype) for _ in range(4))
    update.adam_step(p, s1, s2, 0.1, 0.9, 0.999, 1e-8, 1).apply(g)


@dataclass(frozen=True)
class Unit:
    """One op's kernels: `warm(dtype)` compiles them; `seconds` is their compile time on an
    empty cache (the GEMM and the units of its group listed before it already compiled), by a
    process with one thread (plain loops, `runtime.kernels.threaded`) and with more (parallel
    loops), as `bench/unit_compile_seconds.py` measures it (on the 2-core AMD EPYC VM; a unit
    with no plain twin, GELU's and the embedding's, one figure for both): the
    weight of the assignment (`weight`); units of one `group` go to one process; `probe` is one
    of the kernels, whose cache entry stands for the unit's."""

    warm: Callable[[np.dtype], None]
    seconds: tuple[float, float]
    group: str
    probe: object

    def weight(self) -> float:
        """Its compile time at this process's thread count."""
        return self.seconds[0 if numba.get_num_threads() == 1 else 1]


UNITS: dict[str, Unit] = {
    "filter.untied": Unit(lambda d: _filter(d, True), (0.75, 1.73), "gemm", filter_packed._forward),
    "filter.tied": Unit(lambda d: _filter(d, False), (0.65, 1.60), "gemm", filter_packed._forward),
    "filter.untied.gradient": Unit(
        lambda d: _filter_gradient(d, True),
        (0.88, 2.33),
        "gradient",
        filter_packed._backward_filter_untied,
    ),
    "filter.tied.gradient": Unit(
        lambda d: _filter_gradient(d, False),
        (4.65, 6.95),
        "gradient",
        filter_packed._backward_filter_tied,
    ),
    "filter.step": Unit(_filter_step, (1.16, 2.62), "step", filter_packed._step_untied),
    "filterA": Unit(_affine, (0.38, 1.37), "filterA", affine._forward),
    "filterNL": Unit(_nonlinear, (0.41, 1.15), "filterNL", nonlinear._elementwise),
    "gelu": Unit(_gelu, (3.40, 3.40), "gelu", gelu._forward),
    "linear": Unit(_linear, (0.27, 0.56), "linear", linear._tiled_product),
    "linear.step": Unit(_linear_step, (0.34, 1.12), "linear", linear._stepped_product),
    "softmax": Unit(_softmax, (0.32, 1.05), "softmax", softmax._row_pass),
    "embedding": Unit(_embedding, (0.10, 0.10), "embedding", embedding._scatter_add),
    "layernorm": Unit(_layernorm, (0.52, 1.56), "layernorm", layernorm._backward),
    "matmul": Unit(_matmul, (0.37, 1.16), "matmul", attention._batched),
    "row_softmax": Unit(
        _row_softmax, (0.55, 1.71), "row_softmax", attention._softmax_rows_backward
    ),
    "maxpool": Unit(_maxpool, (0.57, 1.41), "maxpool", pool._forward),
    "avgpool": Unit(_avgpool, (0.49, 1.40), "avgpool", pool._average),
    "dropout": Unit(_dropout, (0.28, 0.74), "dropout", dropout._apply),
    "batchnorm": Unit(_batchnorm, (0.68, 2.47), "batchnorm", batchnorm._stats),
    "update": Unit(lambda d: _update(d, 6), (0.22, 0.21), "update", update.step_elements),
    "update.parallel": Unit(
        lambda d: _update(d, update.CHUNK + 1), (0.25, 0.68), "update", update._apply
    ),
    # every step (`denormals.flushing_denormals`); its arguments are no dtype's (measured on the
    # Intel Xeon VM: 0.05 s after another kernel)
    "denormals": Unit(
        lambda d: denormals.mxcsr(), (0.05, 0.05), "denormals", denormals._swap_mxcsr
    ),
}


def units_of(graph: TaskGraph, program: RankProgram | None = None) -> list[str]:
    """The units a run of `graph` calls, in the order of UNITS. Given the rank's `program`,
    a weight gradient's kernel is the one that steps the weights where the program fuses the
    update into it (`RankTask.steps`), and the one that stores the gradient elsewhere; without
    it, both."""
    stepping = {rt.task.name for rt in program.tasks if rt.steps} if program else None
    fused = {rt.task.name for rt in program.tasks if rt.fused_into is not None} if program else ()

    def steps(task) -> bool:
        return stepping is None or task.name in stepping

    used = {"denormals"}
    for task in graph.tasks:
        if task.op == "conv" and conv.runs_pointwise(task.attrs["kernel"], task.attrs["pad"]):
            used.add("linear")  # its forward and input gradient: the linear layer's product
        if task.op in ("filter", "conv"):
            untied = bool(task.attrs.get("untied"))
            kind = "filter.untied" if untied else "filter.tied"
            used.add(kind)
            if task.phase == "backward":
                if untied and steps(task):
                    used.add("filter.step")
                if not untied or stepping is None or not steps(task):
                    used.add(f"{kind}.gradient")  # a tied filter's step takes it whole
        elif task.op in ("linear", "dense"):  # dense runs on the linear layer's GEMM
            used.add("linear")
            if task.op == "linear" and task.phase == "backward" and steps(task):
                used.add("linear.step")
        elif task.op == "update":
            used.add("update")
            large = graph.tensors[task.requirement("params").tensor].volume > update.CHUNK
            if large and (stepping is None or task.name not in fused):
                used.add("update.parallel")
        elif task.op == "evaluate":
            used.add("softmax")
        elif task.op.startswith("batchnorm"):
            used.add("batchnorm")
        elif task.op in UNITS:
            used.add(task.op)
    return [name for name in UNITS if name in used]


def cached(units: list[str], dtype) -> bool:
    """Whether Numba's cache holds each unit's probe kernel for `dtype`, for the current
    source (Numba's index is stamped with it)."""
    for unit in units:
        probe = UNITS[unit].probe
        if isinstance(probe, ThreadedKernel):  # the twin this process's thread count runs
            probe = probe.current()
        if not in_cache(probe, dtype):
            return False
    return True


def parallel_only(units: list[str]) -> bool:
    """Whether some unit's kernels run parallel loops whatever the thread count: compiled with
    `parallel=True` and no plain twin (GELU's)."""
    for unit in units:
        probe = UNITS[unit].probe
        if not isinstance(probe, ThreadedKernel) and probe.targetoptions.get("parallel"):
            return True
    return False


def warm(units: list[str], dtype) -> None:
    """Compile (or load) the units' kernels in this process."""
    dtype = np.dtype(dtype)
    for name in units:
        UNITS[name].warm(dtype)


def in_cache(dispatcher, dtype) -> bool:
    """Whether Numba's cache holds `dispatcher` compiled for `dtype` (for the current source;
    one whose arguments name no floating type, neither arrays nor pointers of one, is every
    dtype's)."""
    name = np.dtype(dtype).name
    try:
        index = dispatcher._cache._cache_file._load_index()
    except (AttributeError, OSError):  # no cache, or a Numba without this layout
        return False
    return any(_of_dtype(str(key[0]), name) for key in index)


def _of_dtype(signature: str, name: str) -> bool:
    """Whether a compiled signature (Numba's types, as `str` writes them: `Array(float32, 2,
    'C', ...)`, `float64*`) serves `name`: the first floating type it names, that of the data
    (a float32 kernel's statistics are float64 arrays after it), is `name`, or it names none."""
    found = _FLOAT_NAME.search(signature)
    return found is None or found.group() == name


_FLOAT_NAME = re.compile(r"\bfloat(?:16|32|64)\b")
