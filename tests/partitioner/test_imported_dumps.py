"""Imported Chainer dumps partitioned data-parallel (issue 4): batch rows split over ranks,
parameters replicated and their gradients all-reduced, the loss reduced to rank 0.

chainer_opaque.txt (batch 4) holds functions with no shape rule: `Sum` of a parameter /s/w to a
4-byte scalar v3 (touching no batch rows, so it runs whole on one rank and v3 is an ordinary
activation, not a sum over the batch), `Mystery` x (64 bytes) -> v4 (80 bytes, so shaped (4, 5)),
`BiasAdd` v4 + v3 -> v5, and the loss v6.
"""

import json
import math
from pathlib import Path

import pytest

from cli.main import main
from legion_nn.importers import import_dump, parse_dump
from legion_nn.liveness import schedule_from_dump
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.verify import verify
from partitioner.accounting import memory_per_rank
from partitioner.collective_prices import reduction_cost
from partitioner.cost import plan_cost
from partitioner.machine_file import load_machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from partitioner.verify_plan import verify_plan
from tests.paths import FIXTURES

SEED = FIXTURES / "chainer_vgg19_b32.txt"
BRANCH = FIXTURES / "chainer_branch.txt"
OPAQUE = FIXTURES / "chainer_opaque.txt"
BATCH = 32
PARAM_BYTES = 574_668_960
LOSS = "v62"  # the seed's loss, 4 bytes
#: rows of the batch of 32 per rank
SPLITS = {1: [32], 2: [16, 16], 3: [11, 11, 10], 4: [8] * 4, 8: [4] * 8}


@pytest.fixture(scope="module")
def seed():
    dump = parse_dump(SEED)
    return dump, import_dump(dump)


def data_plan(graph, ranks):
    plan = build_plan(graph, builtin(graph, "data", ranks), ranks)
    verify_plan(graph, plan)
    return plan


def bounds(sizes):
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def carries_batch(graph, name):
    """The importer's rule, restated: a non-parameter (or its gradient) of whole 4-byte rows."""
    base = graph.tensors[name.removesuffix(".grad")]
    return base.kind != "param" and base.nbytes % graph.batch == 0 and base.nbytes > 4


@pytest.mark.parametrize("ranks", sorted(SPLITS))
def test_seed_pieces_read_and_write_their_batch_rows(seed, ranks):
    _, graph = seed
    plan = data_plan(graph, ranks)
    rows = bounds(SPLITS[ranks])
    computed = 0
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task.phase not in ("forward", "backward"):
            continue
        computed += 1
        got = [(p.ranks, p.rect.lo[0], p.rect.hi[0]) for p in task_plan.pieces]
        assert got == [((r,), lo, hi) for r, (lo, hi) in enumerate(rows)], task.name
        for piece in task_plan.pieces:
            lo, hi = piece.rect.lo[0], piece.rect.hi[0]
            for req in piece.requirements:
                dims = graph.tensors[req.tensor].dims
                if carries_batch(graph, req.tensor):
                    want = Rect((lo,) + (0,) * (len(dims) - 1), (hi,) + dims[1:])
                elif req.tensor == f"{LOSS}.grad":
                    want = Rect.empty(1)  # one by definition, never materialised
                else:
                    want = Rect.from_dims(dims)  # parameters, their gradients, the loss
                assert req.rect == want, (task.name, req.role, req.tensor)
    assert computed == 92


@pytest.mark.parametrize("ranks", sorted(SPLITS))
def test_seed_batch_tensors_split_and_parameters_replicated(seed, ranks):
    _, graph = seed
    plan = data_plan(graph, ranks)
    sizes = SPLITS[ranks]
    split = params = 0
    for name, tensor in graph.tensors.items():
        layout = plan.layouts[name]
        if carries_batch(graph, name):
            per_row = tensor.volume // BATCH
            assert layout.volumes_by_rank() == {r: n * per_row for r, n in enumerate(sizes)}, name
            split += 1
        elif tensor.kind == "param" or name.removesuffix(".grad") in plan.homes:
            assert layout.volumes_by_rank() == dict.fromkeys(range(ranks), tensor.volume), name
            params += 1
        else:  # the loss and its gradient, on rank 0
            assert name in (LOSS, f"{LOSS}.grad")
            assert layout.volumes_by_rank() == {0: 1}
    assert params == 2 * 38
    assert split == len(graph.tensors) - params - 2


@pytest.mark.parametrize("ranks", sorted(SPLITS))
def test_seed_one_allreduce_per_parameter_gradient(seed, ranks):
    _, graph = seed
    plan = data_plan(graph, ranks)
    machine = load_machine(None)
    reductions = [r for task_plan in plan.tasks for r in task_plan.reductions]
    transfers = [t for task_plan in plan.tasks for t in task_plan.transfers]
    if ranks == 1:
        assert reductions == [] and transfers == []
        return
    params = [t for t in graph.tensors.values() if t.kind == "param"]
    wire = 0
    for param in params:
        (reduction,) = [r for r in reductions if r.tensor == f"{param.name}.grad"]
        assert reduction.algorithm == "allreduce"
        assert reduction.participants == tuple(range(ranks))
        assert reduction.nbytes == param.nbytes
        seconds, sent = reduction_cost(reduction, machine)
        assert sent == 2 * (ranks - 1) * param.nbytes
        ring = 2 * (ranks - 1) * machine.alpha
        ring += 2 * (ranks - 1) / ranks * param.nbytes * machine.beta
        # a small gradient goes up a binomial tree and back down where that is faster, and
        # over a power of two ranks every gradient halves and doubles: the ring's bytes in
        # 2·log2 p exchanges
        levels = math.ceil(math.log2(ranks))
        tree = 2 * levels * (machine.alpha + param.nbytes * machine.beta)
        power = ranks & (ranks - 1) == 0
        halving = ring - 2 * (ranks - 1 - levels) * machine.alpha if power else ring
        assert seconds == pytest.approx(min(ring, tree, halving))
        wire += sent
    assert sum(p.nbytes for p in params) == PARAM_BYTES
    # nothing else moves but the loss, 4 bytes summed onto rank 0
    others = [r for r in reductions if not r.tensor.endswith(".grad")]
    assert all(t.tensor == LOSS and t.reduce and t.dsts == (0,) for t in transfers)
    if ranks == 2:
        assert [(t.src, t.nbytes) for t in transfers] == [(1, 4)]
        assert others == []
    else:
        (loss,) = others
        assert (loss.tensor, loss.algorithm, loss.targets[0][1]) == (LOSS, "reduce", (0,))
    assert len(reductions) == len(params) + len(others)
    total = plan_cost(graph, plan, machine).bytes_sent
    assert wire == 2 * (ranks - 1) * PARAM_BYTES
    assert 0 < total - wire <= 2 * (ranks - 1) * 4


@pytest.mark.parametrize("ranks", sorted(SPLITS))
def test_seed_plan_memory_against_the_memory_analysis(seed, ranks):
    """Different measures: the plan holds every buffer at once (no reuse), `legion-nn memory`
    finds the peak of the live ones. The plan's parameters are exactly the dump's, and what it
    holds is the memory analysis's buffers all at once, each rank with its rows, and the
    staging of its messages: a buffer of each gradient's all-reduce, and a few bytes for the
    loss's sum."""
    dump, graph = seed
    plan = data_plan(graph, ranks)
    memory = memory_per_rank(graph, plan)
    schedule = schedule_from_dump(dump)
    report = schedule.analyze(ranks).to_json()
    assert report["param_bytes"] == PARAM_BYTES
    for rank in range(ranks):
        held = sum(
            plan.homes[t.name].volumes_by_rank()[rank] * t.itemsize
            for t in graph.tensors.values()
            if t.kind == "param"
        )
        assert held == PARAM_BYTES

    def no_reuse(rows: int) -> int:
        return sum(b.nbytes // BATCH * rows if b.scalable else b.nbytes for b in schedule.buffers)

    sizes = SPLITS[ranks]
    for rank in range(ranks):
        # the loss and its gradient live on rank 0; the others hold a 4-byte partial loss
        tensors = no_reuse(sizes[rank]) - (4 if rank else 0)
        all_reduced = PARAM_BYTES if ranks > 1 else 0
        assert 0 <= memory[rank] - tensors - all_reduced <= 2 * 4
    assert report["peak_bytes"] < memory[0]


@pytest.mark.parametrize("ranks, sizes", [(2, [2, 2]), (3, [2, 1, 1]), (4, [1, 1, 1, 1])])
def test_branch_gradient_accumulates_on_each_ranks_rows(ranks, sizes):
    """v5 (4, 3) feeds two LinearFunctions; both backward tasks add into each rank's rows."""
    graph = import_dump(BRANCH)
    plan = data_plan(graph, ranks)
    rows = bounds(sizes)
    by_task = {task_plan.task: task_plan for task_plan in plan.tasks}
    for name in ("v5.grad.set_zero", "LinearFunction-2-2.grad", "LinearFunction-2.grad"):
        for rank, piece in enumerate(by_task[name].pieces):
            (req,) = [r for r in piece.requirements if r.tensor == "v5.grad"]
            assert req.privilege is (Privilege.WRITE if "set_zero" in name else Privilege.REDUCE)
            assert req.write_rect == Rect((rows[rank][0], 0), (rows[rank][1], 3)), name
        assert not [t for t in by_task[name].transfers if t.tensor == "v5.grad"]
        assert not [r for r in by_task[name].reductions if r.tensor == "v5.grad"]
    allreduced = {
        r.tensor for task_plan in plan.tasks for r in task_plan.reductions if r.tensor[0] == "/"
    }
    assert allreduced == {f"/fc{i}/{p}.grad" for i in (1, 2, 3) for p in "Wb"}


def test_opaque_functions_batch_rows_and_a_scalar_on_one_rank():
    graph = import_dump(OPAQUE)
    verify(graph)
    t = graph.tensors
    assert t["v4"].dims == (4, 5)  # no shape rule: (B, bytes / B / 4)
    assert (t["v3"].dims, t["v3"].kind) == ((1,), "activation")
    assert (t["v6"].dims, t["v6"].kind) == ((1,), "stat")
    assert graph.task("Sum-0").attrs["access"] == {"input": "whole", "output": "whole"}
    assert graph.task("BiasAdd-2").attrs["access"]["input1"] == "whole"

    plan = data_plan(graph, 3)
    by_task = {task_plan.task: task_plan for task_plan in plan.tasks}
    assert [p.ranks for p in by_task["Sum-0"].pieces] == [(0,)]
    assert [(p.rect.lo[0], p.rect.hi[0]) for p in by_task["Mystery-1"].pieces] == [
        (0, 2),
        (2, 3),
        (3, 4),
    ]
    assert not by_task["BiasAdd-2"].transfers  # the scalar every rank reads is gathered
    ((copies, scalar),) = by_task["BiasAdd-2"].gathered
    assert (scalar.tensor, scalar.algorithm, scalar.participants, scalar.owners) == (
        "v3",
        "allgather",
        (0, 1, 2),
        (0,),
    )
    assert (copies.src.tolist(), copies.dsts.tolist()) == ([0], [1, 2])
    (partial,) = by_task["BiasAdd-2.grad"].reductions
    assert (partial.tensor, partial.algorithm, partial.targets[0][1]) == ("v3.grad", "reduce", (0,))
    assert plan.homes["/s/w"].volumes_by_rank() == {0: 4}  # only Sum reads it
    assert not [r for r in by_task["Sum-0.grad"].reductions]


def read_json(path):
    return json.loads(Path(path).read_text())


def test_cli_partitions_the_seed_dump_data_parallel(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["partition", str(SEED), "--ranks", "4", "--strategy", "data", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "Convolution2DFunction-0" in table and "4×1×1×1" in table
    report = read_json(out)
    assert (report["ranks"], report["strategy"], report["batch"]) == (4, "data", 32)
    # six times the parameters (ring all-reduces over 4 ranks), and the loss: a binomial-tree
    # reduce of 4 bytes, three sends, under the default machine
    assert report["bytes_sent_total"] == 6 * PARAM_BYTES + 3 * 4
    layers = report["layers"]
    assert len(layers) == 46
    assert layers[0]["layer"] == "Convolution2DFunction-0" and layers[0]["grid"] == [4, 1, 1, 1]
    assert layers[-1]["layer"] == "SoftmaxCrossEntropy-45" and layers[-1]["grid"] == [4, 1]


@pytest.mark.parametrize("strategy", ["model", "spatial"])
def test_cli_refuses_model_and_spatial_on_a_dump(tmp_path, capsys, strategy):
    out = tmp_path / "plan.json"
    args = ["partition", str(BRANCH), "--ranks", "2", "--strategy", strategy, "--json", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--strategy {strategy}" in err
    assert "imported graphs support data parallelism" in err and "use --strategy data" in err
    assert not out.exists()


def test_cli_auto_on_a_dump_is_data(tmp_path, capsys):
    auto, data = tmp_path / "auto.json", tmp_path / "data.json"
    assert main(["partition", str(BRANCH), "--ranks", "3", "--json", str(auto)]) == 0
    assert "cut over the batch only" in capsys.readouterr().err
    args = ["partition", str(BRANCH), "--ranks", "3", "--strategy", "data", "--json", str(data)]
    assert main(args) == 0
    assert read_json(auto) == read_json(data)


def test_exported_graph_of_a_dump_partitions_alike(tmp_path):
    exported = tmp_path / "seed.json"
    assert main(["graph", str(SEED), "--json", str(exported)]) == 0
    reports = []
    for source in (SEED, exported):
        out = tmp_path / f"{source.stem}.plan.json"
        args = ["partition", str(source), "--ranks", "3", "--strategy", "data", "--json", str(out)]
        assert main(args) == 0
        reports.append(read_json(out))
    assert reports[0] == reports[1]


def test_batch_override_and_bad_batch(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["partition", str(BRANCH), "--ranks", "3", "--strategy", "data"]
    assert main([*args, "--batch", "2", "--json", str(out)]) == 0
    assert read_json(out)["batch"] == 2
    capsys.readouterr()
    assert main([*args, "--batch", "0"]) == 2
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err


def test_the_imported_seed_still_renders(tmp_path):
    out = tmp_path / "seed.dot"
    assert main(["render", str(SEED), "-o", str(out), "--collapse", "none"]) == 0
    text = out.read_text()
    for name in ("Convolution2DFunction-0", "SoftmaxCrossEntropy-45.grad", "v62.set_zero"):
        assert name in text


def test_chainer_ops_resolve_to_the_batch_parallel_map():
    from legion_nn.op_records import has_access_map, splittable_dims

    assert has_access_map("chainer.AnyFunction", "backward")
    assert not has_access_map("torch.AnyFunction", "forward")
    graph = import_dump(OPAQUE)
    assert splittable_dims(graph.task("Mystery-1")) == (0,)
    assert splittable_dims(graph.task("Sum-0.grad")) == ()  # no batch rows: one piece


def test_an_unknown_access_class_is_one_line(tmp_path, capsys):
    exported = tmp_path / "branch.json"
    assert main(["graph", str(BRANCH), "--json", str(exported)]) == 0
    data = read_json(exported)
    relu = next(t for t in data["tasks"] if t["name"] == "ReLU-1")
    relu["attrs"]["access"]["input"] = "rows"
    exported.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["partition", str(exported), "--ranks", "2", "--strategy", "data"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "task ReLU-1" in err and "access class 'rows'" in err
