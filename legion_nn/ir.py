"""The task-graph IR as plain data: tensors, region requirements and tasks.

A `Task` names its kernel by the string `op` and carries its attributes (stride, padding, the
nonlinearity, ...) in `attrs`, so a graph pickles, crosses MPI ranks and reads well in a failing
test. Each task has an iteration `space`: the rect the partitioner cuts into pieces. For most tasks it
is the whole result (`dist["result"]`); tasks that reduce a batch to a few statistics (softmax's
loss, evaluate) iterate over the batch while their result is a scalar or a handful of sums.

A `Requirement` says which rect of which tensor a task reads (`read_rect`) and writes (`write_rect`),
under which privilege and in which role. The rects of a task's requirements are what the layer's
access map returns for the task's whole space; a piece of the space gets the access map of the piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

PHASES = ("forward", "backward", "set_zero", "update")
KINDS = ("data", "param", "state", "activation", "grad", "stat")
RESIDENT_KINDS = ("data", "param", "state")
DTYPE_BYTES = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "activation"
    #: total bytes, for imported graphs that know a tensor's size but not its shape
    nbytes_override: int | None = None
    #: how a parameter or state starts: "zeros", "const:<v>", "normal:<std>" or "he:<fan_in>"
    init: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))

    @property
    def rect(self) -> Rect:
        return Rect.from_dims(self.dims)

    @property
    def volume(self) -> int:
        return self.rect.volume

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        if self.nbytes_override is not None:
            return self.nbytes_override
        return self.volume * self.itemsize

    @property
    def resident(self) -> bool:
        """Lives across steps (data is loaded, params and state persist): readable before any write."""
        return self.kind in RESIDENT_KINDS


@dataclass(frozen=True)
class Requirement:
    tensor: str
    role: str
    privilege: Privilege
    read_rect: Rect | None = None
    write_rect: Rect | None = None

    @classmethod
    def read(cls, tensor: str, role: str, rect: Rect) -> Requirement:
        return cls(tensor, role, Privilege.READ, read_rect=rect)

    @classmethod
    def write(cls, tensor: str, role: str, rect: Rect) -> Requirement:
        return cls(tensor, role, Privilege.WRITE, write_rect=rect)

    @classmethod
    def reduce(cls, tensor: str, role: str, rect: Rect) -> Requirement:
        return cls(tensor, role, Privilege.REDUCE, write_rect=rect)

    @classmethod
    def read_write(cls, tensor: str, role: str, rect: Rect) -> Requirement:
        return cls(tensor, role, Privilege.READ_WRITE, read_rect=rect, write_rect=rect)

    @property
    def rect(self) -> Rect | None:
        """The rect the requirement touches (its write rect for writes, else its read rect)."""
        return self.write_rect if self.write_rect is not None else self.read_rect


@dataclass(frozen=True)
class Task:
    name: str
    op: str
    phase: str
    result_dim: tuple[int, ...]
    dist: dict[str, Rect]
    requirements: tuple[Requirement, ...]
    space: Rect
    layer: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "result_dim", tuple(int(d) for d in self.result_dim))
        object.__setattr__(self, "requirements", tuple(self.requirements))

    def requirement(self, role: str) -> Requirement:
        for req in self.requirements:
            if req.role == role:
                return req
        raise KeyError(f"task {self.name} has no requirement with role {role!r}")

    def role_dims(self, tensors: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
        """The dims of the tensor bound to each role: what access maps and FLOP counts take."""
        return {req.role: tensors[req.tensor].dims for req in self.requirements}

    def with_requirements(self, requirements: tuple[Requirement, ...]) -> Task:
        return replace(self, requirements=tuple(requirements))
