"""Chainer graph dumps: the text format, its parser and the records it yields.

The format (the bundled VGG19 dump is its training step at batch 32), one item per line::

    V F                      variable count, function count
    ID BYTES NAME            V times; NAME is `_` when unnamed, parameters start with `/`
    forward|backward         then F records of
    IN OUT                     input and output counts
    ID ROLE                    IN times; ROLE is `_` in forward, gradient/input/output in backward
    ID                         OUT times
    TYPE                       e.g. Convolution2DFunction
    {...}                      JSON attributes, including the integer `rank`

How to read a backward record. A dump has one id per variable and none for gradients: a backward
record names the *forward* variables and the role says which buffer of that variable it touches.

- `ID gradient`: the gradient of forward variable ID (always an output of the matching forward
  function): the incoming gradient, `gy`.
- `ID input` / `ID output`: the data of forward variable ID, an input or an output of the matching
  forward function, read again by the backward pass. The seed lists most functions' forward inputs
  this way whether Chainer retained them or not (Dropout's input, convolution biases); ReLU lists
  only its output.
- an output `ID`: the gradient of forward variable ID (an input of the matching forward function),
  `gx`, `gW` or `gb`. When a variable feeds several functions, several backward records list it as an
  output and its gradient is accumulated.

So "the gradient of v" is the buffer named by id v in a gradient role or a backward output; it has
v's byte size. A `gradient` listing reads v's gradient only: the peak-memory analysis
(`legion_nn.liveness`) frees v's data after the last function that reads it as data, a forward
function taking it as input or a backward record listing it as `input` or `output`.

Each backward record is the backward of the forward record with the same type and rank whose
inputs hold its outputs; the parser pairs them and names both: the forward function
`<Type>-<rank>` (with `-2`, `-3`, ... for further functions of one type at one rank, in file order)
and its backward `<Type>-<rank>.grad`, after the project's `<layer>.grad`.

The batch is the element count of the label input, the variable *named* `1` (int32, so bytes/4;
its id is not 1). Every malformed line raises `LegionNNError("FILE:LINE: expected ..., got ...")`;
a file that ends early names the line after its last and "end of file".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from legion_nn.errors import LegionNNError

DIRECTIONS = ("forward", "backward")
#: the backward role naming a variable's gradient, `gy`; the others name its data
GRADIENT_ROLE = "gradient"
BACKWARD_ROLES = (GRADIENT_ROLE, "input", "output")
LABEL_NAME = "1"
LABEL_ITEMSIZE = 4  # int32


@dataclass(frozen=True)
class Variable:
    id: int
    nbytes: int
    name: str | None  # None where the dump has `_`
    line: int

    @property
    def is_param(self) -> bool:
        return self.name is not None and self.name.startswith("/")


@dataclass(frozen=True)
class Input:
    id: int
    role: str  # `_` in forward records; gradient, input or output in backward ones


@dataclass(frozen=True)
class Function:
    direction: str
    inputs: tuple[Input, ...]
    outputs: tuple[int, ...]
    type: str
    attrs: dict[str, Any] = field(compare=False)
    line: int
    name: str = ""
    #: for a backward record, the index in `Dump.functions` of its forward record
    partner: int | None = None

    @property
    def rank(self) -> int:
        return self.attrs["rank"]

    def ids(self, *roles: str) -> list[int]:
        """The ids of the inputs with one of `roles` (all inputs when none is given)."""
        return [i.id for i in self.inputs if not roles or i.role in roles]


@dataclass(frozen=True)
class Dump:
    source: str
    variables: dict[int, Variable]
    functions: tuple[Function, ...]

    @property
    def forward(self) -> list[Function]:
        return [f for f in self.functions if f.direction == "forward"]

    @property
    def backward(self) -> list[Function]:
        return [f for f in self.functions if f.direction == "backward"]

    def schedule(self) -> list[Function]:
        """Forward functions by ascending rank, then backward by descending rank (ties: file order)."""
        forward = sorted(self.forward, key=lambda f: f.rank)
        backward = sorted(self.backward, key=lambda f: -f.rank)
        return forward + backward

    def produced(self) -> set[int]:
        """Ids of the variables some forward function outputs."""
        return {v for f in self.forward for v in f.outputs}

    @property
    def param_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables.values() if v.is_param)

    def batch(self, override: int | None = None) -> int:
        """`override`, else the element count of the int32 label variable named `1`."""
        if override is not None:
            if override < 1:
                raise LegionNNError(f"the batch must be at least 1, got {override}")
            return override
        for var in self.variables.values():
            if var.name == LABEL_NAME:
                if var.nbytes == 0 or var.nbytes % LABEL_ITEMSIZE:
                    raise LegionNNError(
                        f"{self.source}:{var.line}: the label variable `1` has {var.nbytes} bytes, "
                        f"not a whole number of int32 labels; give --batch"
                    )
                return var.nbytes // LABEL_ITEMSIZE
        raise LegionNNError(
            f"{self.source}: no label variable named `1` to take the batch from; give --batch"
        )


class _Reader:
    """The dump's lines with a cursor; every error names the line it is about."""

    def __init__(self, text: str, source: str) -> None:
        self.lines = text.splitlines()
        self.source = source
        self.next_index = 0

    def error(self, lineno: int, expected: str, got: str) -> LegionNNError:
        return LegionNNError(f"{self.source}:{lineno}: expected {expected}, got {got}")

    def take(self, expected: str) -> tuple[int, list[str]]:
        """The next line's number and its whitespace-separated tokens (never none)."""
        if self.next_index >= len(self.lines):
            raise self.error(self.next_index + 1, expected, "end of file")
        self.next_index += 1
        line = self.lines[self.next_index - 1]
        if not line.strip():
            raise self.error(self.next_index, expected, "an empty line")
        return self.next_index, line.split()

    def shown(self, lineno: int) -> str:
        line = self.lines[lineno - 1].strip()
        return repr(line if len(line) <= 60 else line[:57] + "...")


def _count(token: str) -> int | None:
    """A non-negative decimal integer, or None."""
    return int(token) if token.isascii() and token.isdigit() else None


def _header(reader: _Reader) -> tuple[int, int]:
    expected = "'VARIABLES FUNCTIONS' (two counts)"
    lineno, tokens = reader.take(expected)
    counts = [_count(t) for t in tokens]
    if len(counts) != 2 or None in counts:
        raise reader.error(lineno, expected, reader.shown(lineno))
    return counts[0], counts[1]


def _variable(reader: _Reader, index: int, total: int, seen: dict[int, Variable]) -> Variable:
    expected = f"variable {index} of {total} as 'ID BYTES NAME'"
    lineno, tokens = reader.take(expected)
    if len(tokens) < 3 or _count(tokens[0]) is None or _count(tokens[1]) is None:
        raise reader.error(lineno, expected, reader.shown(lineno))
    var_id = int(tokens[0])
    if var_id in seen:
        raise reader.error(
            lineno, "a new variable id", f"id {var_id} again (first on line {seen[var_id].line})"
        )
    name = reader.lines[lineno - 1].split(maxsplit=2)[2].strip()
    return Variable(var_id, int(tokens[1]), None if name == "_" else name, lineno)


def _variable_id(reader: _Reader, lineno: int, token: str, expected: str, dump_vars: dict) -> int:
    var_id = _count(token)
    if var_id is None:
        raise reader.error(lineno, expected, reader.shown(lineno))
    if var_id not in dump_vars:
        raise reader.error(lineno, "the id of a declared variable", f"id {var_id}")
    return var_id


def _function(reader: _Reader, index: int, total: int, variables: dict[int, Variable]) -> Function:
    where = f"function {index} of {total}"
    expected = f"'forward' or 'backward' ({where})"
    start, tokens = reader.take(expected)
    if len(tokens) != 1 or tokens[0] not in DIRECTIONS:
        raise reader.error(start, expected, reader.shown(start))
    direction = tokens[0]

    expected = f"'INPUTS OUTPUTS' (two counts, {where})"
    lineno, tokens = reader.take(expected)
    counts = [_count(t) for t in tokens]
    if len(counts) != 2 or None in counts:
        raise reader.error(lineno, expected, reader.shown(lineno))
    n_in, n_out = counts

    roles = ("_",) if direction == "forward" else BACKWARD_ROLES
    role_text = "'ID _'" if direction == "forward" else "'ID gradient|input|output'"
    inputs = []
    for k in range(1, n_in + 1):
        expected = f"input {k} of {n_in} as {role_text} ({where}, {direction})"
        lineno, tokens = reader.take(expected)
        if len(tokens) != 2 or tokens[1] not in roles:
            raise reader.error(lineno, expected, reader.shown(lineno))
        inputs.append(
            Input(_variable_id(reader, lineno, tokens[0], expected, variables), tokens[1])
        )

    outputs = []
    for k in range(1, n_out + 1):
        expected = f"output {k} of {n_out} as 'ID' ({where})"
        lineno, tokens = reader.take(expected)
        if len(tokens) != 1:
            raise reader.error(lineno, expected, reader.shown(lineno))
        outputs.append(_variable_id(reader, lineno, tokens[0], expected, variables))

    expected = f"the function type, one word ({where})"
    lineno, tokens = reader.take(expected)
    if len(tokens) != 1:
        raise reader.error(lineno, expected, reader.shown(lineno))
    kind = tokens[0]

    expected = f'a JSON object of attributes with an integer "rank" ({where})'
    lineno, _ = reader.take(expected)
    try:
        attrs = json.loads(reader.lines[lineno - 1])
    except json.JSONDecodeError as exc:
        raise reader.error(
            lineno, expected, f"invalid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(attrs, dict):
        raise reader.error(lineno, expected, f"a JSON {type(attrs).__name__}")
    rank = attrs.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise reader.error(lineno, expected, f"rank {json.dumps(rank)}")
    return Function(direction, tuple(inputs), tuple(outputs), kind, attrs, start)


def _matches(backward: Function, forward: Function) -> bool:
    """Whether `backward` can be the backward record of `forward` (see the module docstring)."""
    if (backward.type, backward.rank) != (forward.type, forward.rank):
        return False
    fwd_in, fwd_out = set(forward.ids()), set(forward.outputs)
    return (
        set(backward.ids("gradient", "output")) <= fwd_out
        and set(backward.ids("input")) <= fwd_in
        and set(backward.outputs) <= fwd_in
    )


def _pair_and_name(reader: _Reader, functions: list[Function]) -> tuple[Function, ...]:
    named = list(functions)
    taken: dict[str, int] = {}
    for i, fn in enumerate(functions):
        if fn.direction == "forward":
            stem = f"{fn.type}-{fn.rank}"
            taken[stem] = taken.get(stem, 0) + 1
            name = stem if taken[stem] == 1 else f"{stem}-{taken[stem]}"
            named[i] = replace(fn, name=name)
    candidates: dict[tuple[str, int], list[int]] = {}
    for j, fn in enumerate(functions):
        if fn.direction == "forward":
            candidates.setdefault((fn.type, fn.rank), []).append(j)
    paired: set[int] = set()
    for i, fn in enumerate(functions):
        if fn.direction == "forward":
            continue
        partner = next(
            (
                j
                for j in candidates.get((fn.type, fn.rank), [])
                if j not in paired and _matches(fn, functions[j])
            ),
            None,
        )
        if partner is None:
            raise reader.error(
                fn.line,
                f"the backward of a forward {fn.type} of rank {fn.rank} whose inputs hold its outputs",
                "no such forward function",
            )
        paired.add(partner)
        named[i] = replace(fn, name=f"{named[partner].name}.grad", partner=partner)
    return tuple(named)


def parse_dump_text(text: str, source: str = "<dump>") -> Dump:
    """Parse the text of a dump; `source` names it in error messages."""
    reader = _Reader(text, source)
    n_vars, n_funcs = _header(reader)
    variables: dict[int, Variable] = {}
    for index in range(1, n_vars + 1):
        var = _variable(reader, index, n_vars, variables)
        variables[var.id] = var
    functions = [_function(reader, index, n_funcs, variables) for index in range(1, n_funcs + 1)]
    for lineno in range(reader.next_index + 1, len(reader.lines) + 1):
        if reader.lines[lineno - 1].strip():
            raise reader.error(
                lineno,
                f"end of file after the {n_funcs} functions of the header",
                reader.shown(lineno),
            )
    return Dump(source, variables, _pair_and_name(reader, functions))


def parse_dump(path_or_text: str | os.PathLike) -> Dump:
    """Parse a dump from a file, or from its text when given a string holding a newline."""
    if isinstance(path_or_text, str) and "\n" in path_or_text:
        return parse_dump_text(path_or_text)
    path = Path(path_or_text)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LegionNNError(f"{path}: not a Chainer graph dump (not UTF-8 text)") from None
    return parse_dump_text(text, str(path))
