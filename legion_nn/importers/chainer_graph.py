"""Import a Chainer dump into a `TaskGraph`: one tensor per variable and gradient, one task per function.

Tensors. A parameter (name starting with `/`) keeps its Chainer name and is kind `param`; a variable
no forward function produces is a step input, kind `data` (the label variable, named `1`, is
int32); a batch-free output of a function over the batch (the loss) is a `stat`, a sum over the
batch; every other variable is an `activation`. Non-parameters are named `v<id>`. The gradient of
variable `t` is the tensor `t.grad`, kind `grad`, for every variable that a backward record reads in
the gradient role or outputs. Every tensor's `nbytes` is the dump's byte size exactly.

Shapes. The dump records bytes, not shapes, so shapes are inferred forward through the functions
whose attributes allow it (convolutions, pooling, linear, reshape, elementwise ops, the loss),
assuming 4-byte elements, square kernels and square images, and are kept only where they reproduce
the recorded byte sizes. A step input feeding a convolution gets the unique (C, H, H) that fits the
filter and the output. Batch-carrying tensors are recognisable: a non-parameter tensor whose byte
size is a multiple of the batch B (and more than one element) has the batch as its first dim; where
no shape is inferred it gets (B, elements per sample), anything else a flat (elements,). This is
the memory analysis's scaling rule, and what the partitioner splits (below).

Tasks, in schedule order (forward by ascending rank, then backward by descending rank), with op
`chainer.<Type>` and attrs `{"chainer": <the dump's attributes>, "access": {role: class}}`. Forward
task `<Type>-<rank>` reads its inputs and writes its outputs (reduces into a `stat`); backward task
`<Type>-<rank>.grad` reads the gradients of the forward outputs (`output.delta`) and the forward
data it lists, and reduces into the gradients of the forward inputs (`input.delta`,
`filters.delta`, `b.delta`). As in lowered graphs, a gradient (and a `stat`) is zeroed by
`<t>.set_zero` right before the first task that touches it, so a variable feeding two functions
accumulates both contributions. The loss gradient, which a backward task reads before anything
writes it, is one by definition and never materialised: as in lowered graphs, it is read with an
empty rect. A task's space is the first batch-carrying tensor it touches (outputs first), its
result its first output; a backward task keeps its forward task's. Requirements come from the
batch-parallel access map (`batch_access`) applied to the space, as lowering does, so `verify`
checks imported graphs like lowered ones and the partitioner plans them data-parallel: batch rows
split over ranks, parameters replicated, their gradients all-reduced, the loss reduced to one rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from legion_nn.access import with_rect
from legion_nn.errors import LegionNNError, VerifyError
from legion_nn.graph import TaskGraph
from legion_nn.importers.batch_access import (
    ACCESS_KEY,
    ATTRS_KEY,
    BATCH,
    NAMESPACE,
    NONE,
    WHOLE,
)
from legion_nn.importers.chainer import GRADIENT_ROLE, LABEL_NAME, Dump, Function, parse_dump
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.registry import access_map
from legion_nn.verify import verify

ITEMSIZE = 4  # float32 and int32: the element size of every variable of a dump
SCALAR_BYTES = ITEMSIZE  # one element: a batch-free scalar even where B divides its size

Shape = tuple[int, ...]
Binding = tuple[str, str, Privilege]  # (role, tensor name, privilege)
#: the task attribute holding the function's attributes as the dump records them

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
        self.batch = batch
        shapes = infer_shapes(dump, batch)
        produced = dump.produced()
        sums = self._batch_sums()
        self.tensors: dict[str, Tensor] = {}
        #: the tensors (and gradients) that carry the batch in dim 0
        self.batchy: set[str] = set()
        for var in dump.variables.values():
            if var.is_param:
                kind = "param"
            elif var.id in sums:
                kind = "stat"
            else:
                kind = "activation" if var.id in produced else "data"
            dtype = "int32" if var.name == LABEL_NAME else "float32"
            dims = _dims(var.nbytes, shapes.get(var.id), batch, var.is_param)
            name = tensor_name(dump, var.id)
            self.tensors[name] = Tensor(name, dims, dtype, kind, nbytes_override=var.nbytes)
            if self.carries(var.id):
                self.batchy.add(name)
        self.tasks: list[Task] = []
        self.touched: set[str] = set()

    def carries(self, var_id: int) -> bool:
        var = self.dump.variables[var_id]
        return is_batch_carrying(var.nbytes, self.batch, var.is_param)

    def _batch_sums(self) -> set[int]:
        """Batch-free outputs of forward functions over the batch: sums over its rows (the loss)."""
        out = set()
        for fn in self.dump.forward:
            if any(self.carries(v) for v in fn.ids() + list(fn.outputs)):
                out.update(v for v in fn.outputs if not self.carries(v))
        return out

    def data(self, var_id: int) -> str:
        return tensor_name(self.dump, var_id)

    def grad(self, var_id: int) -> str:
        base = self.tensors[self.data(var_id)]
        name = f"{base.name}.grad"
        if name not in self.tensors:
            self.tensors[name] = Tensor(
                name, base.dims, base.dtype, "grad", nbytes_override=base.nbytes
            )
            if base.name in self.batchy:
                self.batchy.add(name)
        return name

    def space(self, fn: Function) -> tuple[Rect, Rect]:
        """(space, result) of a forward function, kept by its backward: the space is the first
        batch-carrying tensor it touches, outputs first, so that it cuts over the batch; the
        result is its first output."""
        outputs = [self.data(v) for v in fn.outputs]
        result = self.tensors[outputs[0]].rect if outputs else Rect((), ())
        touched = outputs + [self.data(v) for v in fn.ids()]
        carrier = next((name for name in touched if name in self.batchy), None)
        return (self.tensors[carrier].rect if carrier else result), result

    def forward_bindings(self, fn: Function) -> list[Binding]:
        in_roles, out_roles = _roles(fn)
        bindings = [(in_roles[v], self.data(v), Privilege.READ) for v in fn.ids()]
        for v in fn.outputs:
            name = self.data(v)
            summed = self.tensors[name].kind == "stat"
            bindings.append((out_roles[v], name, Privilege.REDUCE if summed else Privilege.WRITE))
        return bindings

    def backward_bindings(self, fn: Function, forward: Function) -> list[Binding]:
        in_roles, out_roles = _roles(forward)
        bindings = []
        for i in fn.inputs:
            if i.role == GRADIENT_ROLE:
                bindings.append((f"{out_roles[i.id]}.delta", self.grad(i.id), Privilege.READ))
            else:
                role = in_roles[i.id] if i.role == "input" else out_roles[i.id]
                bindings.append((role, self.data(i.id), Privilege.READ))
        for v in fn.outputs:
            bindings.append((f"{in_roles[v]}.delta", self.grad(v), Privilege.REDUCE))
        return bindings

    def access_class(self, tensor: str, privilege: Privilege) -> str:
        unwritten = tensor not in self.touched and self.tensors[tensor].kind == "grad"
        if privilege is Privilege.READ and unwritten:
            return NONE  # the loss gradient: one by definition, never materialised
        return BATCH if tensor in self.batchy else WHOLE

    def task(self, fn: Function, forward: Function, bindings: list[Binding]) -> None:
        """Append `fn`'s task, its requirements from the batch-parallel map over its space, after
        zeroing the gradients and sums it is the first to touch."""
        classes = {role: self.access_class(t, p) for role, t, p in bindings}
        attrs = {ATTRS_KEY: dict(fn.attrs), ACCESS_KEY: classes}
        op = f"{NAMESPACE}.{fn.type}"
        space, result = self.space(forward)
        dims = {role: self.tensors[tensor].dims for role, tensor, _ in bindings}
        rects = access_map(op, fn.direction)(attrs, dims, space)
        reqs = [
            with_rect(Requirement(tensor, role, privilege), rects[role])
            for role, tensor, privilege in bindings
        ]
        for _, tensor, privilege in bindings:
            if tensor not in self.touched and (
                self.tensors[tensor].kind == "grad" or privilege is Privilege.REDUCE
            ):
                self.set_zero(tensor, forward.name)
        task = Task(
            name=fn.name,
            op=op,
            phase=fn.direction,
            result_dim=result.shape,
            dist={"result": result},
            requirements=tuple(reqs),
            space=space,
            layer=forward.name,
            attrs=attrs,
        )
        self.tasks.append(task)
        self.touched.update(tensor for _, tensor, _ in bindings)

    def set_zero(self, tensor: str, layer: str) -> None:
        whole = self.tensors[tensor].rect
        zero = Requirement.write(tensor, "output", whole)
        name = f"{tensor}.set_zero"
        self.tasks.append(
            Task(
                name, "set_zero", "set_zero", whole.shape, {"result": whole}, (zero,), whole, layer
            )
        )
        self.touched.add(tensor)


def import_dump(
    dump: Dump | str | os.PathLike, batch: int | None = None, network: str = ""
) -> TaskGraph:
    """The task graph of one training step recorded in a Chainer dump (a parsed `Dump` or a file)."""
    if not isinstance(dump, Dump):
        dump = parse_dump(dump)
    batch = dump.batch(batch)
    build = _Builder(dump, batch)
    for fn in dump.schedule():
        if fn.direction == "forward":
            build.task(fn, fn, build.forward_bindings(fn))
        else:
            forward = dump.functions[fn.partner]
            build.task(fn, forward, build.backward_bindings(fn, forward))
    name = network or Path(dump.source).stem
    graph = TaskGraph(build.tensors.values(), build.tasks, network=name, batch=batch)
    try:
        verify(graph)
    except VerifyError as exc:  # a dump the importer reads but cannot turn into a valid graph
        raise LegionNNError(f"{dump.source}: imported graph does not verify: {exc}") from None
    return graph
