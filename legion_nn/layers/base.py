"""The `Layer` base class and the registry of layer kinds.

A layer is a small dataclass of hyperparameters. It knows three things: the per-sample shape it
produces from the one it is given (`out_shape`, raising `ShapeError` with what would fit), how it
lowers to tasks (`lower`), and, in its module, the records of its ops (`legion_nn.registry`).

Naming follows the seed. A layer's `name` is a group (`L0`, `classifier`); a layer without a name
joins the group of the layer before it, so `filter`, `filterA`, `filterNL` named `L0` lower to tasks
`L0.filter`, `L0.filterA`, `L0.filterNL` with outputs `L0.filter.output`, ... and backward tasks
`L0.filter.grad`, ... . Parameters are `<group>.<param>` and update tasks `update_<group>.<param>`.

A layer reads the output of the layer before it, unless its `inputs` names other groups (the
latest output of each, at that point of the list; `data` is the network's input). That makes
branches: a ResNet block's shortcut is a layer reading the block's input, and a merge layer
(`MERGES`: `add`, `concat`) reads two or more groups' outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from legion_nn import registry
from legion_nn.access import elementwise, elementwise_boxes
from legion_nn.errors import LegionNNError, ShapeError
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

if TYPE_CHECKING:
    from legion_nn.lowering import Lowering

#: a per-sample shape: images (C, H, W), token ids (T,), sequences (T, D), heads (H, T, Dh)
Shape = tuple[int, ...]
#: what each per-sample rank holds, for errors
RANK_NAMES = {1: "token ids [T]", 2: "a sequence [T, D]", 3: "images [C, H, W]"}

LAYER_KINDS: dict[str, type[Layer]] = {}


#: the FLOPs of an op that moves elements: one per element each way
COPY = {"forward": 1, "backward": 1}


def record_grid_op(
    op: str,
    access: registry.AccessFn,
    flops: Mapping[str, float],
    splittable: registry.Splittable = registry.EVERY_DIM,
    sums_over: int = 0,
    box_map: registry.BoxMap | None = None,
) -> None:
    """Record an op whose pieces run on a grid of their own, in the phases `flops` names, each
    costing that many FLOPs per element of its space, with adapter `<op>.<phase>`; it packs no
    weights and owns no tensors."""
    registry.register(
        op,
        phases={
            phase: {
                "access": access,
                "flops": registry.per_element(count),
                "adapter": f"{op}.{phase}",
                **({"box_map": box_map} if box_map is not None else {}),
            }
            for phase, count in flops.items()
        },
        splittable=splittable,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=sums_over,
    )


def product_roles(inputs, weights, bias, output) -> dict:
    """Every role's rect (or arrays of rects) of a product of an input by weights (`linear`,
    `dense`) from the four a piece touches: a gradient's is its tensor's."""
    return {
        "input": inputs,
        "weights": weights,
        "b": bias,
        "output": output,
        "output.delta": output,
        "input.delta": inputs,
        "weights.delta": weights,
        "b.delta": bias,
    }


#: the roles of a product's backward that its weight gradients touch, and those its input's
#: gradient touches (`registry`'s `weight_grad`)
PRODUCT_WEIGHT_GRAD = ("input", "output.delta", "weights.delta", "b.delta")
PRODUCT_INPUT_GRAD = ("output.delta", "weights", "input.delta")


def record_product(
    op: str,
    access: registry.AccessFn,
    box_map: registry.BoxMap,
    sums_over: int,
    steps: str | None = None,
    defers: bool = False,
) -> None:
    """Record a product of an input by weights (`linear`, `dense`): forward a multiply-add per
    (output, summed) pair of its space, backward the weights' gradient and, unless `need_dx`
    is false, the input's (`backward_factor`); `steps` names the gradient its adapter can step
    the weights from, and `defers` says its adapter computes the weights' gradients apart, over
    several micro-batches' rows (`registry`'s `weight_grad`)."""
    backward = {"access": access, "box_map": box_map, "adapter": f"{op}.backward"}
    registry.register(
        op,
        phases={
            "forward": {
                "access": access,
                "box_map": box_map,
                "flops": registry.per_element(2),
                "adapter": f"{op}.forward",
            },
            "backward": {
                **backward,
                "flops": lambda attrs, dims: backward_factor(attrs),
                **({"steps": steps} if steps else {}),
                **({"weight_grad": (PRODUCT_WEIGHT_GRAD, PRODUCT_INPUT_GRAD)} if defers else {}),
            },
        },
        splittable=registry.EVERY_DIM,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=sums_over,
    )


def record_elementwise(op: str, forward: float, backward: float) -> None:
    """Record an elementwise op costing `forward` and `backward` FLOPs per element."""
    record_grid_op(
        op,
        elementwise,
        {"forward": forward, "backward": backward},
        box_map=elementwise_boxes,
    )


def moving_tasks(
    layer: Layer, ctx: Lowering, x: str, dims: tuple, op: str, attrs: dict, params=()
) -> str:
    """The tasks of a layer that moves its input's elements to other places (and reads
    `params`, (role, tensor) pairs): the forward, and the backward moving the gradient back
    (with its parameters' gradients and updates)."""
    y = ctx.tensor(f"{layer.stem}.output", dims, "activation")
    space = Rect.from_dims(dims)
    reads = [("input", x, Privilege.READ), *((role, t, Privilege.READ) for role, t in params)]
    outputs = [("output", y, Privilege.WRITE)]
    ctx.task(layer.stem, op, "forward", space, reads + outputs, layer.name, attrs)

    def backward() -> None:
        bindings = [("output.delta", ctx.grad(y), Privilege.READ)]
        if ctx.needs_grad(x):
            bindings.append(("input.delta", ctx.grad(x), Privilege.REDUCE))
        bindings += [(f"{role}.delta", ctx.grad(t), Privilege.REDUCE) for role, t in params]
        if len(bindings) > 1:
            ctx.task(f"{layer.stem}.grad", op, "backward", space, bindings, layer.name, attrs)
        for role, t in params:
            ctx.update(t, f"update_{layer.name}.{role}", layer.name)

    ctx.on_backward(backward)
    return y


def backward_factor(attrs: dict[str, Any]) -> float:
    """FLOPs of a backward per forward multiply-add pair of its space: the input gradient unless
    the input needs none (`need_dx`), and the weight gradient unless a micro-batched step
    deferred it (`need_dw`); a deferred weight gradient's task sums every micro-batch's rows
    (`micro_rows`) over a space as tall as the first."""
    rows = attrs.get("micro_rows")
    if rows:
        return 2 * sum(rows) / max(rows)
    weights = 2 if attrs.get("need_dw", True) else 0
    return (2 if attrs.get("need_dx", True) else 0) + weights


def layer_kind(kind: str):
    """Class decorator registering a layer kind for spec files and the Python API."""

    def wrap(cls: type[Layer]) -> type[Layer]:
        cls.KIND = kind
        LAYER_KINDS[kind] = cls
        return cls

    return wrap


@dataclass
class Layer:
    KIND: ClassVar[str] = ""
    #: the task-name stem, `<group>.<OP_NAME>`; defaults to the kind
    OP_NAME: ClassVar[str] = ""
    #: whether the layer reads several inputs (`inputs`): `out_shape` and `lower` then take a
    #: tuple of shapes and of tensors
    MERGES: ClassVar[bool] = False
    #: the per-sample ranks of the inputs the layer takes (`RANK_NAMES`)
    RANKS: ClassVar[tuple[int, ...]] = (3,)
    #: what errors say the layer takes, where not `RANK_NAMES`' words for its ranks
    TAKES: ClassVar[str] = ""

    name: str = ""
    #: the groups whose outputs the layer reads; empty: the output of the layer before it
    inputs: tuple[str, ...] = field(default=(), kw_only=True)

    @property
    def label(self) -> str:
        return f"layer {self.name or '?'} ({self.KIND})"

    @property
    def stem(self) -> str:
        return f"{self.name}.{self.OP_NAME or self.KIND}"

    def out_shape(self, shape: Shape) -> Shape:
        raise NotImplementedError

    def lower(self, ctx: Lowering, x: str, shape: Shape) -> str:
        """Emit this layer's forward tasks (and register its backward); return its output tensor."""
        raise NotImplementedError

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": self.KIND}
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            if option.name == "inputs" and not value:
                continue
            spec[option.name] = list(value) if isinstance(value, tuple) else value
        return spec


@dataclass
class ElementwiseLayer(Layer):
    """A layer of one elementwise op: task `<g>.<op>` over its output, backward `<g>.<op>.grad`."""

    RANKS = (2, 3)
    #: whether the backward reads the forward output (filterNL's derivatives are functions of it)
    BACKWARD_READS_OUTPUT: ClassVar[bool] = False
    #: whether the backward reads the forward input (gelu's derivative is a function of it only)
    BACKWARD_READS_INPUT: ClassVar[bool] = False

    def attrs(self) -> dict[str, Any]:
        return {}

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx: Lowering, x: str, shape: Shape) -> str:
        op = self.OP_NAME or self.KIND
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {**self.attrs(), **sequence_axes(shape)}
        bindings = [("input", x, Privilege.READ), ("output", y, Privilege.WRITE)]
        ctx.task(self.stem, op, "forward", space, bindings, self.name, attrs)

        def backward() -> None:
            if not ctx.needs_grad(x):
                return
            reads = [("output.delta", ctx.grad(y), Privilege.READ)]
            if self.BACKWARD_READS_OUTPUT:
                reads.append(("output", y, Privilege.READ))
            if self.BACKWARD_READS_INPUT:
                reads.append(("input", x, Privilege.READ))
            bindings = reads + [("input.delta", ctx.grad(x), Privilege.REDUCE)]
            ctx.task(f"{self.stem}.grad", op, "backward", space, bindings, self.name, attrs)

        ctx.on_backward(backward)
        return y


def sequence_axes(shape: Shape) -> dict[str, str]:
    """The `axes` attr (`legion_nn.registry.axis_roles`) of a task over the batch and a
    sequence's per-sample `shape`: tokens are positions, a sequence's last dim its features;
    none for images, whose dims the default roles describe."""
    return {"axes": {1: "NS", 2: "NSF"}[len(shape)]} if len(shape) < 3 else {}


def check_rank(layer: Layer, shape: Shape) -> None:
    """A ShapeError unless `layer` takes inputs of `shape`'s per-sample rank."""
    if len(shape) not in layer.RANKS:
        takes = layer.TAKES or " or ".join(RANK_NAMES[r] for r in layer.RANKS)
        raise ShapeError(f"{layer.label}: takes {takes}, got {list(shape)}")


def layer_from_spec(spec: dict[str, Any], where: str) -> Layer:
    """Build a layer from one entry of a spec file's `layers` list; `where` names it in errors."""
    if not isinstance(spec, dict):
        raise LegionNNError(f"{where}: a layer must be an object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in LAYER_KINDS:
        known = ", ".join(sorted(LAYER_KINDS))
        raise LegionNNError(f"{where}: unknown layer kind {kind!r}; known kinds: {known}")
    cls = LAYER_KINDS[kind]
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - allowed - {"kind"})
    if unknown:
        raise LegionNNError(
            f"{where}: {kind} layer has no option {unknown[0]!r}; options: {', '.join(sorted(allowed))}"
        )
    try:
        return cls(**{k: v for k, v in spec.items() if k != "kind"})
    except (TypeError, ValueError) as exc:
        raise LegionNNError(f"{where}: {exc}") from None


def one_of(option: str, value: Any, choices: Sequence[str]) -> None:
    """Require one of `choices` for a layer's `option` (ValueError naming them)."""
    if value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


# Hyperparameter normalisation shared by windowed layers.


def pair(value: Any, what: str) -> tuple[int, int]:
    """An int or a 2-list as (rows, cols), each a positive int."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        out = (value, value)
    elif (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}")
    if min(out) < 1:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return out


def padding(value: Any) -> tuple[int, int, int, int]:
    """An int, (rows, cols) or (top, bottom, left, right) as a non-negative 4-tuple."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = (value,) * 4
    elif isinstance(value, (list, tuple)) and len(value) in (2, 4):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"pad must hold ints, got {value!r}")
        out = (value[0], value[0], value[1], value[1]) if len(value) == 2 else tuple(value)
    else:
        raise ValueError(
            f"pad must be an int, [rows, cols] or [top, bottom, left, right], got {value!r}"
        )
    if min(out) < 0:
        raise ValueError(f"pad must not be negative, got {value!r}")
    return out  # type: ignore[return-value]


def positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def window_out(
    layer: Layer, shape: Shape, window: tuple[int, int], stride: tuple[int, int], pad: tuple
) -> tuple[int, int]:
    """Output rows and columns of a sliding window, or a ShapeError saying what would fit."""
    _, h, w = shape
    top, bottom, left, right = pad
    ph, pw = h + top + bottom, w + left + right
    if window[0] > ph or window[1] > pw:
        raise ShapeError(
            f"{layer.label}: window {window[0]}x{window[1]} is larger than its padded input "
            f"{ph}x{pw} (input shape {list(shape)}); a window of at most {min(window[0], ph)}x"
            f"{min(window[1], pw)} would fit"
        )
    return ((ph - window[0]) // stride[0] + 1, (pw - window[1]) // stride[1] + 1)
