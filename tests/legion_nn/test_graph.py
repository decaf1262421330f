"""Dependences come from overlapping rects and conflicting privileges, in program order."""

from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.networks import load_network
from legion_nn.rect import Rect

WHOLE = Rect.from_dims((4, 4))
TOP, BOTTOM = Rect((0, 0), (2, 4)), Rect((2, 0), (4, 4))


def task(name, *requirements):
    return Task(name, "custom", "forward", (4, 4), {"result": WHOLE}, requirements, WHOLE)


def deps(*tasks):
    graph = TaskGraph([Tensor("t", (4, 4)), Tensor("u", (4, 4))], tasks)
    return {(d.src, d.dst): d.kind for d in graph.dependences}


def test_raw_war_waw():
    w1 = task("w1", Requirement.write("t", "output", WHOLE))
    r = task("r", Requirement.read("t", "input", TOP))
    w2 = task("w2", Requirement.write("t", "output", TOP))
    found = deps(w1, r, w2)
    assert found == {("w1", "r"): "RAW", ("r", "w2"): "WAR", ("w1", "w2"): "WAW"}


def test_disjoint_rects_do_not_conflict():
    found = deps(
        task("a", Requirement.write("t", "output", TOP)),
        task("b", Requirement.write("t", "output", BOTTOM)),
        task("c", Requirement.read("t", "input", BOTTOM)),
    )
    assert found == {("b", "c"): "RAW"}


def test_reads_commute_and_same_operator_reductions_commute():
    found = deps(
        task("zero", Requirement.write("t", "output", WHOLE)),
        task("r1", Requirement.read("t", "input", WHOLE)),
        task("r2", Requirement.read("t", "input", WHOLE)),
        task("red1", Requirement.reduce("u", "output", WHOLE)),
        task("red2", Requirement.reduce("u", "output", WHOLE)),
        task("use", Requirement.read("u", "input", TOP)),
    )
    assert ("r1", "r2") not in found and ("red1", "red2") not in found
    assert found[("zero", "r1")] == "RAW" and found[("zero", "r2")] == "RAW"
    assert found[("red1", "use")] == "RAW" and found[("red2", "use")] == "RAW"


def test_empty_read_creates_no_dependence():
    found = deps(
        task("w", Requirement.write("t", "output", WHOLE)),
        task("r", Requirement.read("t", "input", Rect.empty(2))),
    )
    assert found == {}


def test_seed_graph_orders_the_step():
    graph = load_network("seed-lcn-small").lower(batch=4)
    kinds = {(d.src, d.dst, d.tensor): d.kind for d in graph.dependences}
    assert kinds[("L0.filter", "L0.filterA", "L0.filter.output")] == "RAW"
    # The update of L1.W must wait for the backward task that still reads the old weights.
    assert kinds[("L1.filter.grad", "update_L1.W", "L1.W")] == "WAR"
    assert kinds[("L1.W.grad.set_zero", "L1.filter.grad", "L1.W.grad")] == "RAW"
    # Two reads of L1.W (forward and backward) do not order each other through L1.W.
    assert ("L1.filter", "L1.filter.grad", "L1.W") not in kinds
    # Every dependence points forward in program order.
    order = {t.name: i for i, t in enumerate(graph.tasks)}
    assert all(order[d.src] < order[d.dst] for d in graph.dependences)


def test_branch_accumulates_without_ordering_the_two_reductions():
    # A tensor read by two tasks gets its gradient from two reductions that commute.
    graph = TaskGraph(
        [Tensor("x", (4, 4)), Tensor("x.grad", (4, 4), kind="grad")],
        [
            task("x.grad.set_zero", Requirement.write("x.grad", "output", WHOLE)),
            task("a.grad", Requirement.reduce("x.grad", "input.delta", WHOLE)),
            task("b.grad", Requirement.reduce("x.grad", "input.delta", WHOLE)),
        ],
    )
    pairs = {(d.src, d.dst) for d in graph.dependences}
    assert pairs == {("x.grad.set_zero", "a.grad"), ("x.grad.set_zero", "b.grad")}


def test_a_task_that_writes_nothing_runs_last_and_holds_no_rank_before_its_backward():
    """evaluate's accuracy reads the step's statistics and writes nothing: it goes after every
    update, so the rank that runs it (0) starts its backward without waiting for every rank's
    forward to have sent it their sums."""
    from partitioner.machine import Machine
    from partitioner.plan import build_plan
    from partitioner.strategy import builtin
    from runtime.step.programs import build_programs

    graph = load_network("seed-lcn-small").lower(batch=8)
    assert graph.tasks[-1].name == "classifier.evaluate.accuracy"
    assert [t.name for t in graph.tasks[:-1]] == [
        t.name for t in load_network("seed-lcn-small").lower(batch=8).tasks if t.op != "accuracy"
    ]
    plan = build_plan(graph, builtin(graph, "data", 4), 4)
    program = build_programs(graph, plan, Machine(), [0])[0]
    backward = next(i for i, rt in enumerate(program.tasks) if rt.task.phase == "backward")
    assert all(rt.complete_before == () for rt in program.tasks[: backward + 1])
    (accuracy,) = [i for i, rt in enumerate(program.tasks) if rt.task.op == "accuracy"]
    assert all(rt.task.phase != "backward" for rt in program.tasks[accuracy:])
    assert program.tasks[accuracy].complete_before  # where the statistics' sums are due
