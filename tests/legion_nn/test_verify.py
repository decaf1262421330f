"""verify() accepts every built-in and rejects each kind of broken graph with its exact message."""

from dataclasses import replace

import pytest

from legion_nn.errors import VerifyError
from legion_nn.graph import Dependence, TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.networks import BUILTINS, load_network
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.verify import problems, verify


@pytest.mark.parametrize("network", sorted(BUILTINS))
@pytest.mark.parametrize("batch", [1, 7, 256])
def test_builtins_verify(network, batch):
    verify(load_network(network).lower(batch=batch))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_optimizers_verify(optimizer):
    graph = load_network("three-layer-convnet").lower(batch=3, optimizer=optimizer)
    verify(graph)
    update = graph.task("update_conv1.W")
    roles = [r.role for r in update.requirements]
    expected = {"sgd": [], "momentum": ["velocity"], "adam": ["m", "v"]}[optimizer]
    assert roles == ["gradient", "params"] + expected


def small_graph():
    return load_network("seed-lcn-small").lower(batch=4)


def rebuild(graph, tasks=None, tensors=None, extra=()):
    return TaskGraph(
        tensors if tensors is not None else graph.tensors.values(),
        tasks if tasks is not None else graph.tasks,
        graph.network,
        graph.batch,
        extra_dependences=extra,
    )


def replace_task(graph, name, **changes):
    return [replace(t, **changes) if t.name == name else t for t in graph.tasks]


def replace_requirement(graph, task_name, role, **changes):
    task = graph.task(task_name)
    reqs = tuple(replace(r, **changes) if r.role == role else r for r in task.requirements)
    return replace_task(graph, task_name, requirements=reqs)


def test_rect_outside_dims():
    g = small_graph()
    tasks = replace_requirement(
        g, "L0.filterA", "input", read_rect=Rect((0, 0, 0, 0), (5, 8, 16, 16))
    )
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, tasks))
    assert str(err.value) == (
        "task L0.filterA: input requirement on L0.filter.output: read_rect "
        "Rect(array([0, 0, 0, 0], dtype=int32), array([5, 8, 16, 16], dtype=int32)) "
        "is outside its dims [4, 8, 16, 16]"
    )


def test_rect_of_wrong_rank():
    g = small_graph()
    tasks = replace_requirement(g, "L0.filterA", "a", read_rect=Rect((0, 0), (1, 1)))
    with pytest.raises(
        VerifyError,
        match=r"task L0.filterA: a requirement on L0.a: read_rect .* has 2 dims but the tensor has 1 \(dims \[1\]\)",
    ):
        verify(rebuild(g, tasks))


def test_privilege_without_its_rect():
    g = small_graph()
    tasks = replace_requirement(g, "L0.filterA", "output", write_rect=None)
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, tasks))
    assert str(err.value) == (
        "task L0.filterA: output requirement on L0.filterA.output: write privilege needs "
        "no read_rect and a write_rect"
    )


def test_undeclared_tensor_and_duplicate_name():
    g = small_graph()
    tensors = [t for t in g.tensors.values() if t.name != "L0.a"]
    assert problems(rebuild(g, tensors=tensors))[0] == (
        "task L0.filterA: role a names undeclared tensor L0.a"
    )
    tasks = g.tasks + [g.tasks[1]]
    assert "task L0.filter: name used by two tasks" in problems(rebuild(g, tasks))


def test_result_dim_must_match_dist_result():
    g = small_graph()
    tasks = replace_task(g, "L0.filterNL", result_dim=(4, 8, 16, 15))
    with pytest.raises(
        VerifyError,
        match=r"task L0.filterNL: result_dim \[4, 8, 16, 15\] is not the shape of dist_result",
    ):
        verify(rebuild(g, tasks))


def test_inconsistent_dims_between_producer_and_consumer():
    # The consumer's halo no longer matches the producer's tensor: the access map disagrees.
    g = small_graph()
    tasks = replace_requirement(
        g, "L1.filter", "input", read_rect=Rect((0, 0, 0, 0), (4, 8, 15, 16))
    )
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, tasks))
    assert str(err.value) == (
        "task L1.filter: input requirement on L0.filterNL.output has read_rect "
        "Rect(array([0, 0, 0, 0], dtype=int32), array([4, 8, 15, 16], dtype=int32)) but the "
        "filter access map of its space gives "
        "Rect(array([0, 0, 0, 0], dtype=int32), array([4, 8, 16, 16], dtype=int32)) "
        "(tensor dims [4, 8, 16, 16])"
    )


def test_tensor_dims_changed_under_a_task():
    g = small_graph()
    tensors = [
        replace(t, dims=(4, 8, 16, 17)) if t.name == "L0.filter.output" else t
        for t in g.tensors.values()
    ]
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, tensors=tensors))
    assert str(err.value) == (
        "tensor L0.filter.output (dims [4, 8, 16, 17]): no task writes "
        "Rect(array([0, 0, 0, 16], dtype=int32), array([4, 8, 16, 17], dtype=int32))"
    )


def test_cycle():
    g = small_graph()
    extra = [Dependence("L0.filterA", "L0.filter", "L0.filter.output", "RAW")]
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, extra=extra))
    assert str(err.value) == "dependence cycle: L0.filter -> L0.filterA -> L0.filter"


def test_read_before_any_write():
    g = small_graph()
    tasks = [t for t in g.tasks if t.name != "L0.filterA"]
    with pytest.raises(VerifyError) as err:
        verify(rebuild(g, tasks))
    assert str(err.value).startswith(
        "task L0.filterNL reads L0.filterA.output Rect(array([0, 0, 0, 0], dtype=int32), "
        "array([4, 8, 16, 16], dtype=int32)) before any earlier task writes"
    )


def test_reduction_into_a_gradient_that_was_never_zeroed():
    g = small_graph()
    tasks = [t for t in g.tasks if t.name != "L0.W.grad.set_zero"]
    with pytest.raises(
        VerifyError,
        match=r"^task L0.filter.grad reduces into L0.W.grad .* before any earlier task writes",
    ):
        verify(rebuild(g, tasks))


def test_resident_tensors_need_no_writer():
    tensors = [Tensor("w", (2, 2), kind="param"), Tensor("y", (2, 2))]
    whole = Rect.from_dims((2, 2))
    task = Task(
        "t",
        "custom",
        "forward",
        (2, 2),
        {"result": whole},
        (Requirement.read("w", "input", whole), Requirement.write("y", "output", whole)),
        whole,
    )
    verify(TaskGraph(tensors, [task]))
    tensors[0] = Tensor("w", (2, 2), kind="activation")
    with pytest.raises(VerifyError, match="task t reads w"):
        verify(TaskGraph(tensors, [task]))


def test_problems_lists_everything():
    g = small_graph()
    tasks = replace_requirement(g, "L0.filterA", "output", write_rect=None)
    tasks = [t for t in tasks if t.name != "L0.W.grad.set_zero"]
    found = problems(rebuild(g, tasks))
    assert len(found) >= 2
    assert Privilege.WRITE.value in found[0]


def test_a_task_graph_file_that_does_not_verify_is_refused_on_load(tmp_path, capsys):
    import json

    from cli.main import main

    path = tmp_path / "graph.json"
    assert main(["graph", "seed-lcn-small", "--batch", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    data["tasks"] = [t for t in data["tasks"] if t["name"] != "L0.filter"]  # L0's output: unwritten
    path.write_text(json.dumps(data))
    capsys.readouterr()
    for command in (["partition", str(path), "--ranks", "2"], ["graph", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: the task graph does not verify" in err
