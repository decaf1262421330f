"""Import a Chainer dump into a `TaskGraph`: one tensor per variable and gradient, one task per function.

Tensors. A parameter (name starting with `/`) keeps its Chainer name and is kind `param`; a variable
no forward function produces is a step input, kind `data` (the label variable, named `1`, is
int32); every other variable is an `activation` named `v<id>`. The gradient of variable `t` is the
tensor `t.grad`, kind `grad`, for every variable that a backward record reads in the gradient role
or outputs. Every tensor's `nbytes` is the dump's byte size exactly.

Shapes. The dump records bytes, not shapes, so shapes are inferred forward through the functions
whose attributes allow it (convolutions, pooling, linear, reshape, elementwise ops, the loss),
assuming 4-byte elements, square kernels and square images, and are kept only where they reproduce
the recorded byte sizes. A step input feeding a convolution gets the unique (C, H, H) that fits the
filter and the output. Batch-carrying tensors are recognisable: a non-parameter tensor whose byte
size is a multiple of the batch B (and more than one element) has the batch as its first dim; where
no shape is inferred it gets (B, elements per sample), anything else a flat (elements,).

Tasks, in schedule order (forward by ascending rank, then backward by descending rank). Forward
task `<Type>-<rank>` reads its inputs and writes its outputs; backward task `<Type>-<rank>.grad`
reads the gradients of the forward outputs (`output.delta`) and the forward data it lists, and
reduces into the gradients of the forward inputs (`input.delta`, `filters.delta`, `b.delta`). As in
lowered graphs, a gradient is zeroed by `<t>.grad.set_zero` right before the first task that
touches it, so a variable feeding two functions accumulates both contributions. The loss gradient,
which a backward task reads before anything writes it, is one by definition and never
materialised: as in lowered graphs, it is read with an empty rect. Other requirements name whole
tensors. Task ops are the Chainer types, which have no access maps (yet): `verify` checks the
names, rects, dataflow and coverage of an imported graph, not its lowering.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from legion_nn.graph import TaskGraph
from legion_nn.importers.chainer import LABEL_NAME, Dump, Function, parse_dump
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.rect import Rect

ITEMSIZE = 4  # float32 and int32: the element size of every variable of a dump
SCALAR_BYTES = ITEMSIZE  # one element: a batch-free scalar even where B divides its size

Shape = tuple[int, ...]

#: role names of a forward function's inputs by position; unlisted: input, input1, input2, ...
INPUT_ROLES: dict[str, tuple[str, ...]] = {
    "Convolution2DFunction": ("input", "filters", "b"),
    "LinearFunction": ("input", "weights", "b"),
    "SoftmaxCrossEntropy": ("input", "labels"),
}


def is_batch_carrying(nbytes: int, batch: int, param: bool) -> bool:
    """The data-parallel rule: a non-parameter whose size is a multiple of B and not a scalar."""
    return not param and nbytes % batch == 0 and nbytes > SCALAR_BYTES


@dataclass
class _Shapes:
    """Shapes inferred so far, by variable id."""

    dump: Dump
    batch: int
    known: dict[int, Shape] = field(default_factory=dict)

    def elements(self, var_id: int) -> int:
        return self.dump.variables[var_id].nbytes // ITEMSIZE

    def fits(self, var_id: int, shape: Shape) -> bool:
        nbytes = self.dump.variables[var_id].nbytes
        return all(d >= 0 for d in shape) and math.prod(shape) * ITEMSIZE == nbytes


ShapeRule = Callable[[Function, _Shapes], dict[int, Shape]]


def _same(fn: Function, s: _Shapes) -> dict[int, Shape]:
    x = s.known.get(fn.inputs[0].id)
    return {y: x for y in fn.outputs} if x else {}


def _reshape(fn: Function, s: _Shapes) -> dict[int, Shape]:
    target = list(fn.attrs.get("shape") or [])
    known = math.prod(d for d in target if d != -1)
    if target.count(-1) == 1 and known > 0:
        target[target.index(-1)] = s.elements(fn.outputs[0]) // known
    return {fn.outputs[0]: tuple(target)} if target else {}


def _window(extent: int, kernel: int, stride: int, pad: int, cover_all: bool) -> int:
    span = extent + 2 * pad - kernel + (stride - 1 if cover_all else 0)
    return span // stride + 1


def _pooling(fn: Function, s: _Shapes) -> dict[int, Shape]:
    x, a = s.known.get(fn.inputs[0].id), fn.attrs
    if not x or len(x) != 4:
        return {}
    cover = bool(a.get("cover_all", True))
    h = _window(x[2], a["kh"], a["sy"], a["ph"], cover)
    w = _window(x[3], a["kw"], a["sx"], a["pw"], cover)
    return {fn.outputs[0]: (x[0], x[1], h, w)}


def _image_shapes(s: _Shapes, x_id: int, per_filter: int, groups: int) -> list[Shape]:
    """(B, C, H, H) candidates for a step input: C·k² = groups·`per_filter`, square images."""
    per_sample, rest = divmod(s.elements(x_id), s.batch)
    if rest:
        return []
    shapes = []
    for k in range(1, math.isqrt(per_filter) + 1):
        channels, odd = divmod(per_filter * groups, k * k)
        if odd or per_sample % channels:
            continue
        side = math.isqrt(per_sample // channels)
        if side * side * channels == per_sample:
            shapes.append((s.batch, channels, side, side))
    return shapes


def _convolution(fn: Function, s: _Shapes) -> dict[int, Shape]:
    ids, a = fn.ids(), fn.attrs
    if len(ids) < 3:  # without a bias, the output channels are not recorded on their own
        return {}
    x_id, w_id, b_id = ids[:3]
    out_channels, groups = s.elements(b_id), a.get("groups", 1)
    per_filter = s.elements(w_id) // max(out_channels, 1)  # C/groups · k · k
    if x_id in s.known:
        candidates = [s.known[x_id]]
    else:
        candidates = _image_shapes(s, x_id, per_filter, groups)
    cover = bool(a.get("cover_all", False))
    found = []
    for x in candidates:
        if len(x) != 4 or x[1] % groups:
            continue
        k = math.isqrt(per_filter // max(x[1] // groups, 1))
        if k * k * (x[1] // groups) != per_filter:
            continue
        kh, kw = (k - 1) * a.get("dy", 1) + 1, (k - 1) * a.get("dx", 1) + 1
        h = _window(x[2], kh, a["sy"], a["ph"], cover)
        w = _window(x[3], kw, a["sx"], a["pw"], cover)
        found.append(
            {
                x_id: x,
                w_id: (out_channels, x[1] // groups, k, k),
                b_id: (out_channels,),
                fn.outputs[0]: (x[0], out_channels, h, w),
            }
        )
    found = [shapes for shapes in found if s.fits(fn.outputs[0], shapes[fn.outputs[0]])]
    return found[0] if len(found) == 1 else {}


def _linear(fn: Function, s: _Shapes) -> dict[int, Shape]:
    ids = fn.ids()
    x_id, w_id = ids[:2]
    x = s.known.get(x_id) or (s.batch, s.elements(x_id) // s.batch)
    if len(x) != 2 or x[1] == 0:
        return {}
    out = s.elements(w_id) // x[1]
    shapes = {x_id: x, w_id: (out, x[1]), fn.outputs[0]: (x[0], out)}
    if len(ids) > 2:
        shapes[ids[2]] = (out,)
    return shapes


def _loss(fn: Function, s: _Shapes) -> dict[int, Shape]:
    if fn.attrs.get("reduce", "mean") == "no":
        return {fn.outputs[0]: (s.batch,)}
    return {fn.outputs[0]: (1,)}


SHAPE_RULES: dict[str, ShapeRule] = {
    "Add": _same,
    "ReLU": _same,
    "Dropout": _same,
    "Sigmoid": _same,
    "Tanh": _same,
    "LeakyReLU": _same,
    "Reshape": _reshape,
    "MaxPooling2D": _pooling,
    "AveragePooling2D": _pooling,
    "Convolution2DFunction": _convolution,
    "LinearFunction": _linear,
    "SoftmaxCrossEntropy": _loss,
}


def infer_shapes(dump: Dump, batch: int) -> dict[int, Shape]:
    """Shapes of the variables the attributes determine, checked against the recorded bytes."""
    s = _Shapes(dump, batch)
    for var in dump.variables.values():
        if var.name == LABEL_NAME and var.nbytes == batch * ITEMSIZE:
            s.known[var.id] = (batch,)
    for fn in dump.schedule():
        rule = SHAPE_RULES.get(fn.type)
        if fn.direction != "forward" or rule is None or not fn.inputs or not fn.outputs:
            continue
        try:
            found = rule(fn, s)
        except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
            continue  # attributes missing or of the wrong type: leave the shapes unknown
        if all(s.fits(v, shape) and s.known.get(v, shape) == shape for v, shape in found.items()):
            s.known.update(found)
    return s.known


def _dims(nbytes: int, inferred: Shape | None, batch: int, param: bool) -> Shape:
    batchy = is_batch_carrying(nbytes, batch, param)
    if inferred is not None and len(inferred) > 0 and (inferred[0] == batch) == batchy:
        return inferred
    if batchy:
        return (batch, -(-nbytes // (batch * ITEMSIZE)))
    return (-(-nbytes // ITEMSIZE),)


def tensor_name(dump: Dump, var_id: int) -> str:
    """A parameter's Chainer name; `v<id>`, or `v<id>_<name>` where the dump names it."""
    var = dump.variables[var_id]
    if var.is_param:
        return var.name
    return f"v{var_id}" if var.name is None else f"v{var_id}_{var.name}"


def _roles(fn: Function) -> tuple[dict[int, str], dict[int, str]]:
    """Role names of a forward function's input and output ids (the first role of a repeated id)."""
    names = INPUT_ROLES.get(fn.type, ())
    inputs: dict[int, str] = {}
    for k, var_id in enumerate(fn.ids()):
        default = "input" if k == 0 else f"input{k}"
        inputs.setdefault(var_id, names[k] if k < len(names) else default)
    outputs: dict[int, str] = {}
    for k, var_id in enumerate(fn.outputs):
        outputs.setdefault(var_id, "output" if len(fn.outputs) == 1 else f"output{k}")
    return inputs, outputs


class _Builder:
    """Tensors by name and tasks in order, built from one dump."""

    def __init__(self, dump: Dump, batch: int) -> None:
        self.dump = dump
        shapes = infer_shapes(dump, batch)
        produced = dump.produced()
        self.tensors: dict[str, Tensor] = {}
        for var in dump.variables.values():
            kind = "param" if var.is_param else "activation" if var.id in produced else "data"
            dtype = "int32" if var.name == LABEL_NAME else "float32"
            dims = _dims(var.nbytes, shapes.get(var.id), batch, var.is_param)
            name = tensor_name(dump, var.id)
            self.tensors[name] = Tensor(name, dims, dtype, kind, nbytes_override=var.nbytes)
        self.tasks: list[Task] = []

    def data(self, var_id: int) -> str:
        return tensor_name(self.dump, var_id)

    def grad(self, var_id: int) -> str:
        base = self.tensors[self.data(var_id)]
        name = f"{base.name}.grad"
        if name not in self.tensors:
            self.tensors[name] = Tensor(
                name, base.dims, base.dtype, "grad", nbytes_override=base.nbytes
            )
        return name

    def read(self, name: str, role: str) -> Requirement:
        return Requirement.read(name, role, self.tensors[name].rect)

    def forward_requirements(self, fn: Function) -> list[Requirement]:
        in_roles, out_roles = _roles(fn)
        reqs = [self.read(self.data(v), in_roles[v]) for v in fn.ids()]
        for v in fn.outputs:
            name = self.data(v)
            reqs.append(Requirement.write(name, out_roles[v], self.tensors[name].rect))
        return reqs

    def backward_requirements(
        self, fn: Function, forward: Function, written: set[str]
    ) -> list[Requirement]:
        in_roles, out_roles = _roles(forward)
        reqs = []
        for i in fn.inputs:
            if i.role == "gradient":
                name = self.grad(i.id)
                role = f"{out_roles[i.id]}.delta"
                if name in written:
                    reqs.append(self.read(name, role))
                else:  # the loss gradient: one by definition, never materialised
                    rank = len(self.tensors[name].dims)
                    reqs.append(Requirement.read(name, role, Rect.empty(rank)))
            else:
                role = in_roles[i.id] if i.role == "input" else out_roles[i.id]
                reqs.append(self.read(self.data(i.id), role))
        for v in fn.outputs:
            name = self.grad(v)
            reqs.append(Requirement.reduce(name, f"{in_roles[v]}.delta", self.tensors[name].rect))
        return reqs

    def add(
        self,
        name: str,
        op: str,
        phase: str,
        reqs: list[Requirement],
        space: Rect,
        layer: str,
        attrs: dict,
    ) -> None:
        self.tasks.append(
            Task(name, op, phase, space.shape, {"result": space}, tuple(reqs), space, layer, attrs)
        )


def import_dump(
    dump: Dump | str | os.PathLike, batch: int | None = None, network: str = ""
) -> TaskGraph:
    """The task graph of one training step recorded in a Chainer dump (a parsed `Dump` or a file)."""
    if not isinstance(dump, Dump):
        dump = parse_dump(dump)
    batch = dump.batch(batch)
    build = _Builder(dump, batch)
    written: set[str] = set()
    for fn in dump.schedule():
        forward = fn if fn.direction == "forward" else dump.functions[fn.partner]
        out = build.data(forward.outputs[0]) if forward.outputs else None
        space = build.tensors[out].rect if out else Rect((), ())
        if fn.direction == "forward":
            reqs = build.forward_requirements(fn)
        else:
            reqs = build.backward_requirements(fn, forward, written)
            for name in dict.fromkeys(
                r.tensor for r in reqs if build.tensors[r.tensor].kind == "grad"
            ):
                if name not in written:
                    whole = build.tensors[name].rect
                    zero = Requirement.write(name, "output", whole)
                    build.add(
                        f"{name}.set_zero", "set_zero", "set_zero", [zero], whole, forward.name, {}
                    )
                    written.add(name)
        build.add(fn.name, fn.type, fn.direction, reqs, space, forward.name, dict(fn.attrs))
    name = network or Path(dump.source).stem
    return TaskGraph(build.tensors.values(), build.tasks, network=name, batch=batch)
