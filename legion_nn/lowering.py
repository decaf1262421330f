"""Lowering: the builder that turns a network's layers into one training step's task graph.

Program order, which is the graph's meaning:

1. the `data` task writes the batch (`data.raw_output`) and its labels (`data.labels_output`);
2. each layer's forward tasks, in layer order;
3. each layer's backward tasks in reverse layer order. A gradient tensor `<t>.grad` is zeroed by
   `<t>.grad.set_zero` right before the first task that touches it, because backward tasks
   accumulate into gradients with `reduce` privilege (a tensor feeding two layers gets both
   contributions). Any other tensor that is reduced into (the loss, evaluate's sums) gets
   `<t>.set_zero` the same way;
4. as soon as a layer's backward tasks are emitted, the update tasks of its parameters, so that a
   runtime can overlap gradient reduction and updates with the rest of the backward pass;
5. last, the tasks that write nothing (`evaluate.accuracy`, whose value is a future): nothing
   waits for them, and the rank that runs one needs every rank's statistics first.

Requirements are never written by hand: `task()` applies the op's access map to the task's space.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.registry import access_map

OPTIMIZERS = {
    "sgd": {"lr": 0.01},
    "momentum": {"lr": 0.01, "momentum": 0.9},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
}
OPTIMIZER_STATE = {"sgd": (), "momentum": ("velocity",), "adam": ("m", "v")}

Binding = tuple[str, str, Privilege]  # (role, tensor name, privilege)


class Lowering:
    def __init__(
        self,
        network: str,
        batch: int,
        dtype: str = "float32",
        optimizer: str = "sgd",
        hyperparameters: dict[str, float] | None = None,
        param_names: dict[str, str] | None = None,
    ) -> None:
        if optimizer not in OPTIMIZERS:
            raise LegionNNError(
                f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        self.network = network
        self.batch = batch
        self.dtype = dtype
        self.optimizer = optimizer
        self.hyperparameters = {**OPTIMIZERS[optimizer], **(hyperparameters or {})}
        #: parameters to name otherwise than their layers do (`Network.param_names`)
        self.param_names = dict(param_names or {})
        self.tensors: dict[str, Tensor] = {}
        self.tasks: list[Task] = []
        self._touched: set[str] = set()
        self._backward: list[Callable[[], None]] = []
        self.linear_count = 0
        #: the batch's labels, and the latest softmax's probabilities, for the layers that need them
        self.labels = ""
        self.probability: str | None = None

    # Tensors

    def tensor(
        self, name: str, dims: tuple[int, ...], kind: str, dtype: str | None = None, init: str = ""
    ) -> str:
        if name in self.tensors:
            raise LegionNNError(f"tensor {name} is defined twice; give the layers distinct names")
        self.tensors[name] = Tensor(name, tuple(dims), dtype or self.dtype, kind, init=init)
        return name

    def param(self, name: str, dims: tuple[int, ...], init: str) -> str:
        return self.tensor(self.param_names.get(name, name), dims, "param", init=init)

    def dims(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].dims

    def needs_grad(self, name: str) -> bool:
        """Whether backward tasks produce a gradient for `name`: never for the step's data."""
        return self.tensors[name].kind != "data"

    def grad(self, name: str) -> str:
        """The gradient tensor of `name`, created on first use."""
        grad_name = f"{name}.grad"
        if grad_name not in self.tensors:
            self.tensor(grad_name, self.dims(name), "grad")
        return grad_name

    # Tasks

    def task(
        self,
        name: str,
        op: str,
        phase: str,
        space: Rect,
        bindings: list[Binding],
        layer: str,
        attrs: dict[str, Any] | None = None,
        dist_roles: tuple[str, ...] = (),
        result: Rect | None = None,
        result_dim: tuple[int, ...] | None = None,
    ) -> Task:
        """Append a task; its requirements come from the access map over `space`."""
        attrs = dict(attrs or {})
        dims = {role: self.dims(tensor) for role, tensor, _ in bindings}
        rects = access_map(op, phase)(attrs, dims, space)
        requirements = []
        for role, tensor, privilege in bindings:
            rect = rects[role]
            requirements.append(
                Requirement(
                    tensor,
                    role,
                    privilege,
                    read_rect=rect if privilege.reads else None,
                    write_rect=rect if privilege.writes else None,
                )
            )
        self._zero_before_use(requirements, layer)
        result = result if result is not None else space
        dist = {role: rects[role] for role in dist_roles}
        dist["result"] = result
        task = Task(
            name=name,
            op=op,
            phase=phase,
            result_dim=result_dim if result_dim is not None else result.shape,
            dist=dist,
            requirements=tuple(requirements),
            space=space,
            layer=layer,
            attrs=attrs,
        )
        self.tasks.append(task)
        for req in requirements:
            self._touched.add(req.tensor)
        return task

    def _zero_before_use(self, requirements: list[Requirement], layer: str) -> None:
        for req in requirements:
            tensor = self.tensors[req.tensor]
            if req.tensor in self._touched:
                continue
            if tensor.kind == "grad" or req.privilege is Privilege.REDUCE:
                self._touched.add(req.tensor)
                whole = tensor.rect
                self.tasks.append(
                    Task(
                        name=f"{req.tensor}.set_zero",
                        op="set_zero",
                        phase="set_zero",
                        result_dim=tensor.dims,
                        dist={"result": whole},
                        requirements=(Requirement.write(req.tensor, "output", whole),),
                        space=whole,
                        layer=layer,
                    )
                )

    def on_backward(self, build: Callable[[], None]) -> None:
        """Register a layer's backward builder; they run in reverse registration order."""
        self._backward.append(build)

    def update(self, param: str, task_name: str, layer: str, rect: Rect | None = None) -> None:
        """The update task of one parameter (of `rect` of it, for a sparse update)."""
        whole = rect if rect is not None else self.tensors[param].rect
        bindings: list[Binding] = [
            ("gradient", self.grad(param), Privilege.READ),
            ("params", param, Privilege.READ_WRITE),
        ]
        for state in OPTIMIZER_STATE[self.optimizer]:
            state_name = self.tensor(f"{param}.{state}", self.dims(param), "state", init="zeros")
            bindings.append((state, state_name, Privilege.READ_WRITE))
        attrs = {"optimizer": self.optimizer, **self.hyperparameters}
        self.task(task_name, "update", "update", whole, bindings, layer, attrs)

    def finish(self) -> TaskGraph:
        for build in reversed(self._backward):
            build()
        self._backward.clear()
        # a task that writes nothing (its value is a future: evaluate's accuracy) goes last:
        # nothing waits for it, and in its forward place it held the rank that runs it until
        # every rank's statistics had arrived, before that rank's backward could start
        writes = [any(r.write_rect is not None for r in t.requirements) for t in self.tasks]
        tasks = [t for t, w in zip(self.tasks, writes) if w]
        tasks += [t for t, w in zip(self.tasks, writes) if not w]
        return TaskGraph(self.tensors.values(), tasks, network=self.network, batch=self.batch)
