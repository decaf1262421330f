"""Optimizer updates: SGD, momentum and Adam, applied in place, with PyTorch's semantics.

Each rule takes the gradient scaled by `grad_scale` (gradient clipping's factor, 1 otherwise) and a
weight decay: L2 for SGD and momentum (g ← g + wd·p, as `torch.optim.SGD`), decoupled for Adam
(p ← p·(1 − lr·wd) before the step, as `torch.optim.AdamW`). Momentum keeps PyTorch's buffer
b ← μ·b + g and steps p ← p − lr·b, so a learning rate that changes between steps scales the
whole step, as it does there.

An `OptimizerStep` is one step of one rule over a parameter (or a piece of it) and its optimizer
state. It runs in one of two ways, with the same arithmetic:

- `apply(grad)`: the `update_<layer>.<param>` task, over a gradient held in memory. The rule is
  elementwise, so a contiguous piece is flattened as a view and split into chunks among Numba's
  threads; a strided piece, such as a channel slice of a weight, is walked one last-axis row at a
  time, still in place.
- fused into the kernel that computes the gradient (`filter_packed.backward_filter_packed`
  with a `step`, `linear.linear_weight_grad_step`): each block of the gradient is stepped while
  it is still in the core's cache (`step_elements`), and the gradient is never stored. At the
  seed's L1 (585 MB of weights, batch 64, Adam) the gradient and the update took 103–114 +
  41–65 ms as two passes and 128 ms fused: the gradient's write and read are gone, and the
  update's traffic overlaps the products.

The arithmetic is in the parameter's dtype, as PyTorch's Adam does it: with float32 weights the
square root and the division run on twice the lanes of float64, which at the seed's L1 took the
fused step from 160 to 129 ms. Adam is written p −= (lr/c1)·m / (√v·(1/√c2) + eps) with the
bias corrections c1 = 1 − β1ᵗ and c2 = 1 − β2ᵗ folded into two coefficients, the same value as
lr·(m/c1)/(√(v/c2) + eps) up to a few roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

from runtime.kernels._checks import floating, same_dtype
from runtime.kernels._checks import shape as check_shape
from runtime.kernels.threaded import threaded

#: the rules, as the compiled kernels take them
SGD, MOMENTUM, ADAM = 0, 1, 2
#: elements per parallel chunk of `apply`
CHUNK = 1 << 16


@intrinsic
def run_view(typingctx, array, offset, count):
    """Elements offset .. offset + count of `array`'s memory as a unit-stride 1-d view, in
    compiled code: a run of a strided piece, or of a block of a gradient in a kernel's scratch,
    which `step_elements` then steps as it would a whole array."""
    if not isinstance(array, types.Array):
        return None
    result = types.Array(array.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        source = make_array(signature.args[0])(context, builder, args[0])
        view = make_array(result)(context, builder)
        itemsize = context.get_constant(
            types.intp, context.get_abi_sizeof(context.get_data_type(result.dtype))
        )
        populate_array(
            view,
            data=builder.gep(source.data, [args[1]]),
            shape=[args[2]],
            strides=[itemsize],
            itemsize=itemsize,
            meminfo=source.meminfo,
            parent=source.parent,
        )
        return impl_ret_borrowed(context, builder, result, view._getvalue())

    return result(array, types.intp, types.intp), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def step_elements(rule, co, g, p, s1, s2):
    """One step of `rule` over 1-d unit-stride arrays of one length (`run_view` makes them
    from any array); `co` holds the rule's coefficients in p's dtype, and s1, s2 its state
    (where the rule has less, p stands in).

    One compiled function, called by the update task's kernel and by every fused one, so a
    run compiles the rules' loops once. NumPy's error model: Python's checks every division
    for a zero divisor, which keeps the loops from vectorising (4.5× slower); a zero divisor
    (eps = 0 and v = 0) gives inf or NaN, as in NumPy and PyTorch. Without decay or clipping
    (keep 1, wd 0, scale 1) each extra product is exact, so the step is the plain rule's."""
    if rule == ADAM:
        b1, a1, b2, a2, step, root, eps = co[0], co[1], co[2], co[3], co[4], co[5], co[6]
        keep, scale = co[7], co[8]
        for i in range(p.shape[0]):
            gi = g[i] * scale
            mi = b1 * s1[i] + a1 * gi
            vi = b2 * s2[i] + a2 * gi * gi
            s1[i] = mi
            s2[i] = vi
            p[i] = p[i] * keep - step * mi / (np.sqrt(vi) * root + eps)
    elif rule == MOMENTUM:
        lr, mu, wd, scale = co[0], co[1], co[2], co[3]
        for i in range(p.shape[0]):
            b = mu * s1[i] + (g[i] * scale + wd * p[i])
            s1[i] = b
            p[i] -= lr * b
    else:
        lr, wd, scale = co[0], co[1], co[2]
        for i in range(p.shape[0]):
            p[i] -= lr * (g[i] * scale + wd * p[i])


@threaded
def _apply(rule, co, g, p, s1, s2):
    n = p.shape[0]
    for chunk in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = chunk * CHUNK, min(n, (chunk + 1) * CHUNK)
        step_elements(rule, co, g[lo:hi], p[lo:hi], s1[lo:hi], s2[lo:hi])


@dataclass(frozen=True)
class OptimizerStep:
    """One step of `rule` over `params` and its `state` (momentum: its buffer; Adam: m, v),
    all of one shape, dtype and layout; `coefficients` in the parameter's dtype."""

    rule: int
    params: np.ndarray
    state: tuple[np.ndarray, ...]
    coefficients: np.ndarray

    @property
    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(params, s1, s2) as the compiled kernels take them: the parameter stands in for state
        the rule does not have (and is not touched as such)."""
        s1, s2 = (*self.state, self.params, self.params)[:2]
        return self.params, s1, s2

    def shares_strides(self, shape: tuple[int, ...] | None = None) -> bool:
        """Whether params and state share their strides (and `shape`, when given): then one
        offset addresses an element in each, as the fused kernels require."""
        arrays = (self.params, *self.state)
        return all(a.strides == self.params.strides for a in arrays) and (
            shape is None or self.params.shape == tuple(shape)
        )

    def apply(self, grad: np.ndarray) -> None:
        """The step, with `grad` in memory, in place on params and state."""
        names = ("velocity",) if self.rule == MOMENTUM else ("m", "v")
        others = {"grad": grad, **dict(zip(names, self.state))}
        for p, g, *state in _rows(self.params, others):
            s1, s2 = (*state, p, p)[:2]
            if p.size <= CHUNK:  # a bias, a row: no parallel loop to start (or to compile)
                step_elements(self.rule, self.coefficients, g, p, s1, s2)
            else:
                _apply(self.rule, self.coefficients, g, p, s1, s2)


def _coefficients(params: np.ndarray, *values: float) -> np.ndarray:
    floating("param", params)
    return np.array(values, dtype=params.dtype)


def sgd_step(
    params: np.ndarray, lr: float, weight_decay: float = 0.0, grad_scale: float = 1.0
) -> OptimizerStep:
    """param −= lr·(grad_scale·grad + weight_decay·param)."""
    return OptimizerStep(SGD, params, (), _coefficients(params, lr, weight_decay, grad_scale))


def momentum_step(
    params: np.ndarray,
    buffer: np.ndarray,
    lr: float,
    mu: float,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
) -> OptimizerStep:
    """buffer = mu·buffer + (grad_scale·grad + weight_decay·param); param −= lr·buffer."""
    co = _coefficients(params, lr, mu, weight_decay, grad_scale)
    return OptimizerStep(MOMENTUM, params, (buffer,), co)


def adam_step(
    params: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
) -> OptimizerStep:
    """Adam with bias correction, of grad_scale·grad, after the decoupled decay
    param ← param·(1 − lr·weight_decay) (AdamW); `step` counts from 1."""
    if int(step) != step or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"beta1 {beta1} and beta2 {beta2} must be in [0, 1)")
    c1 = 1.0 - float(beta1) ** int(step)
    c2 = 1.0 - float(beta2) ** int(step)
    co = _coefficients(
        params, beta1, 1.0 - beta1, beta2, 1.0 - beta2, lr / c1, 1.0 / np.sqrt(c2), eps,
        1.0 - lr * weight_decay, grad_scale,
    )  # fmt: skip
    return OptimizerStep(ADAM, params, (m, v), co)


def optimizer_step(
    attrs, views, step: int, lr_scale: float = 1.0, grad_scale: float = 1.0
) -> OptimizerStep:
    """The step of an `update` task: its attrs (optimizer and hyper-parameters), its views
    (params and state, by role), the training step it runs in (counting from 0), the
    schedule's factor on the learning rate there (`runtime.lr_schedule`) and the factor on the
    gradient (clipping's, `runtime.grad_clipping`)."""
    params = views["params"]
    lr = attrs["lr"] * lr_scale
    decay = attrs.get("weight_decay", 0.0)
    if attrs["optimizer"] == "sgd":
        return sgd_step(params, lr, decay, grad_scale)
    if attrs["optimizer"] == "momentum":
        return momentum_step(params, views["velocity"], lr, attrs["momentum"], decay, grad_scale)
    return adam_step(
        params, views["m"], views["v"], lr, attrs["beta1"], attrs["beta2"], attrs["eps"],
        step + 1, decay, grad_scale,
    )  # fmt: skip


@njit(cache=True, nogil=True)
def _sum_squares(a):
    total = 0.0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        total += x * x
    return total


@threaded
def _sum_squares_chunked(a):
    n = a.shape[0]
    partial = np.zeros((n + CHUNK - 1) // CHUNK)
    for chunk in prange(partial.shape[0]):
        partial[chunk] = _sum_squares(a[chunk * CHUNK : min(n, (chunk + 1) * CHUNK)])
    return partial.sum()


def squared_norm(array: np.ndarray) -> float:
    """Σ x² over `array` (any layout), in float64 whatever its dtype: a chunk's sum per thread,
    the chunks added in order, so the same array gives the same sum on every run."""
    total = 0.0
    for (row,) in _rows(array, {}):
        total += float(_sum_squares(row) if row.size <= CHUNK else _sum_squares_chunked(row))
    return total


def _rows(param: np.ndarray, others: dict[str, np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """Matching 1-d views of param and the other arrays that together cover every element."""
    floating("param", param)
    for name, a in others.items():
        floating(name, a)
        check_shape(name, a, param.shape)
        same_dtype(name, a, "param", param)
    arrays = (param, *others.values())
    if all(a.flags.c_contiguous for a in arrays):
        return [tuple(a.reshape(-1) for a in arrays)]
    if all(a.flags.f_contiguous for a in arrays):
        return [tuple(a.reshape(-1, order="F") for a in arrays)]
    return [tuple(a[idx] for a in arrays) for idx in np.ndindex(param.shape[:-1])]
