"""Peak-memory analysis: figures derived by hand for small dumps and graphs, the seed pinned, the CLI.

The hand derivations follow `legion_nn.memory`'s rules; per function, the buffers live (bytes):

chainer_chain.txt, batch 4 (label `1` is 16 bytes). Always live: parameters 24+12+24+8 = 68, the
input 32 and labels 16, so 116 at R=1. v4 [0,1] 48, v5 [1,6] 48 (read as data by
LinearFunction-2.grad and ReLU-1.grad), v8 [2,4] 32, loss v9 [3,3] 4; gradients: v9.grad [4,4] 4,
v8.grad [4,5] 32, v1_1.grad [4,4] 16 (read by nothing), v5.grad [5,6] 48, v4.grad [6,7] 48,
v0_0.grad [7,7] 32; parameter gradients from their writer to the end: fc2 [5,7] 24+8, fc1 [7,7] 24+12.

    R=1: 116+48=164, +48+48=212, +48+32=196, +48+32+4=200, +48+32+4+32+16=248,
         +48+32+48+24+8=276, +48+48+24+8+48=292, +24+8+48+32+24+12=264    peak 292 at ReLU-1.grad
    R=2: batch-carrying buffers halve (the 4-byte loss and its gradient do not): resident 92;
         116, 140, 132, 136, 160, 188, 196, 200                            peak 200 at LinearFunction-0.grad
    R=4: quarter: resident 80; 92, 104, 100, 104, 116, 144, 148, 168       peak 168 at LinearFunction-0.grad

chainer_branch.txt: v5 feeds two LinearFunctions of rank 2 (fc2, fc3) whose outputs are added.
Resident 100 + 32 + 16 = 148. v5 lives [1,10]; its gradient is allocated by the first backward that
outputs it (fc3's, function 8), accumulated by fc2's (9) and freed after ReLU-1.grad (10).

    R=1: 196, 244, 228, 260, 292, 232, 280, 292, 340, 340, 356, 328       peak 356 at ReLU-1.grad
    R=2: 148, 172, 164, 180, 196, 168, 192, 196, 236, 252, 260, 264       peak 264 at LinearFunction-0.grad
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from legion_nn.cli import main
from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.importers import import_dump, parse_dump
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.memory import schedule_from_dump, schedule_from_graph
from legion_nn.rect import Rect

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SEED = FIXTURES / "chainer_vgg19_b32.txt"
CHAIN = FIXTURES / "chainer_chain.txt"
BRANCH = FIXTURES / "chainer_branch.txt"

SEED_PEAKS = {
    1: (3_258_544_320, "ReLU-26.grad"),
    2: (2_182_770_816, "ReLU-26.grad"),
    4: (1_645_809_760, "ReLU-17.grad"),
    8: (1_392_922_704, "ReLU-17.grad"),
}


@pytest.mark.parametrize(
    "ranks, live, peak_at",
    [
        (1, [164, 212, 196, 200, 248, 276, 292, 264], "ReLU-1.grad"),
        (2, [116, 140, 132, 136, 160, 188, 196, 200], "LinearFunction-0.grad"),
        (4, [92, 104, 100, 104, 116, 144, 148, 168], "LinearFunction-0.grad"),
        (8, [92, 104, 100, 104, 116, 144, 148, 168], "LinearFunction-0.grad"),  # ceil(4/8) = 1
    ],
)
def test_chain_by_hand(ranks, live, peak_at):
    report = schedule_from_dump(parse_dump(CHAIN)).analyze(ranks)
    assert list(report.live) == live
    assert (report.peak_bytes, report.peak_step.name) == (max(live), peak_at)
    result = report.to_json()
    assert result["param_bytes"] == 68
    assert (result["forward_functions"], result["backward_functions"]) == (4, 4)


@pytest.mark.parametrize(
    "ranks, live, peak_at",
    [
        (1, [196, 244, 228, 260, 292, 232, 280, 292, 340, 340, 356, 328], "ReLU-1.grad"),
        (2, [148, 172, 164, 180, 196, 168, 192, 196, 236, 252, 260, 264], "LinearFunction-0.grad"),
    ],
)
def test_branch_by_hand(ranks, live, peak_at):
    schedule = schedule_from_dump(parse_dump(BRANCH))
    report = schedule.analyze(ranks)
    assert list(report.live) == live
    assert report.peak_step.name == peak_at
    grad = next(b for b in schedule.buffers if b.name == "v5.grad")
    names = [step.name for step in schedule.steps]
    assert names[grad.first] == "LinearFunction-2-2.grad"  # the first of the two producers
    assert names[grad.last] == "ReLU-1.grad"  # its reader, after the second producer
    data = next(b for b in schedule.buffers if b.name == "v5")
    assert (names[data.first], names[data.last]) == ("ReLU-1", "ReLU-1.grad")


@pytest.fixture(scope="module")
def seed_schedule():
    return schedule_from_dump(parse_dump(SEED))


@pytest.mark.parametrize("ranks", sorted(SEED_PEAKS))
def test_seed_peaks(seed_schedule, ranks):
    report = seed_schedule.analyze(ranks)
    assert (report.peak_bytes, report.peak_step.name) == SEED_PEAKS[ranks]
    result = report.to_json()
    assert result["param_bytes"] == 574_668_960
    assert (result["forward_functions"], result["backward_functions"]) == (46, 46)


def test_imported_graph_agrees_with_the_dump(seed_schedule):
    """The two feeders agree; only the loss gradient differs: counted in a dump, never materialised
    (read with an empty rect) in a graph."""
    graph_schedule = schedule_from_graph(import_dump(SEED))
    assert [s.name for s in graph_schedule.steps] == [s.name for s in seed_schedule.steps]
    for ranks in SEED_PEAKS:
        dump_live = seed_schedule.live_bytes(ranks)
        graph_live = graph_schedule.live_bytes(ranks)
        diff = {
            seed_schedule.steps[i].name: d - g
            for i, (d, g) in enumerate(zip(dump_live, graph_live))
            if d != g
        }
        assert diff == {"SoftmaxCrossEntropy-45.grad": 4}


def test_lowered_vgg19_matches_the_seed_dump(seed_schedule):
    from legion_nn.networks import load_network

    schedule = schedule_from_graph(load_network("vgg19").lower(batch=32))
    assert schedule.param_bytes == 574_668_960
    for ranks, (peak, _) in SEED_PEAKS.items():
        assert schedule.analyze(ranks).peak_bytes == peak


def _hand_graph() -> TaskGraph:
    """x·W = y, a loss; batch 2. W has optimizer state; the loss gradient is read with an empty rect."""

    def whole(dims):
        return Rect.from_dims(dims)

    tensors = [
        Tensor("x", (2, 3), kind="data"),
        Tensor("W", (3, 3), kind="param"),
        Tensor("W.velocity", (3, 3), kind="state"),
        Tensor("y", (2, 3)),
        Tensor("loss", (1,), kind="stat"),
        Tensor("loss.grad", (1,), kind="grad"),
        Tensor("y.grad", (2, 3), kind="grad"),
        Tensor("W.grad", (3, 3), kind="grad"),
    ]
    dims = {t.name: t.dims for t in tensors}

    def task(name, phase, *reqs):
        space = whole((2, 3))
        return Task(name, "op", phase, space.shape, {"result": space}, reqs, space)

    def read(n):
        return Requirement.read(n, n, whole(dims[n]))

    def reduce(n):
        return Requirement.reduce(n, n, whole(dims[n]))

    tasks = [
        task("mm", "forward", read("x"), read("W"), Requirement.write("y", "y", whole((2, 3)))),
        task("loss", "forward", read("y"), reduce("loss")),
        task("loss.grad.set_zero", "set_zero", Requirement.write("loss.grad", "o", whole((1,)))),
        task(
            "loss.backward",
            "backward",
            Requirement.read("loss.grad", "d", Rect.empty(1)),
            read("y"),
            reduce("y.grad"),
        ),
        task("mm.grad", "backward", read("y.grad"), read("x"), reduce("W.grad")),
        task("update", "update", read("W.grad"), Requirement.read_write("W", "p", whole((3, 3)))),
    ]
    return TaskGraph(tensors, tasks, network="hand", batch=2)


def test_task_graph_by_hand():
    """Resident: x 24 (scaled), W 36, its velocity 36 (state, live all step, not scaled): 96.
    y [0,2] 24; loss [1,1] 4 (a stat, never scaled); y.grad [2,3] 24; W.grad [3,end] 36; the
    empty-rect read of loss.grad and the set_zero and update tasks allocate nothing.
    R=1: 120, 124, 144, 156. R=2 (x, y, y.grad halve; resident 84): 96, 100, 108, 132."""
    schedule = schedule_from_graph(_hand_graph())
    assert [s.name for s in schedule.steps] == ["mm", "loss", "loss.backward", "mm.grad"]
    assert schedule.live_bytes(1) == [120, 124, 144, 156]
    assert schedule.live_bytes(2) == [96, 100, 108, 132]
    assert schedule.param_bytes == 36
    report = schedule.analyze(2)
    assert (report.peak_bytes, report.peak_step.name) == (132, "mm.grad")


def test_ranks_must_be_positive():
    with pytest.raises(LegionNNError, match="--ranks must be at least 1"):
        schedule_from_dump(parse_dump(CHAIN)).analyze(0)


# The command line


def test_cli_json_for_each_rank_count(tmp_path, capsys):
    for ranks, (peak, at) in SEED_PEAKS.items():
        out = tmp_path / f"m{ranks}.json"
        assert main(["memory", str(SEED), "--ranks", str(ranks), "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["peak_bytes"] == peak and result["peak_at"] == at
        assert result["param_bytes"] == 574_668_960
        assert (result["forward_functions"], result["backward_functions"]) == (46, 46)
        assert result["ranks"] == ranks and result["batch"] == 32
        assert len(result["schedule"]) == 92
    assert f"{peak:,} bytes" in capsys.readouterr().out


def test_cli_batch_override(tmp_path):
    out = tmp_path / "m.json"
    assert main(["memory", str(CHAIN), "--batch", "2", "--ranks", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["batch"] == 2


@pytest.mark.parametrize(
    "suffix, magic", [("png", b"\x89PNG"), ("svg", b"<?xml"), ("pdf", b"%PDF")]
)
def test_cli_plot(tmp_path, suffix, magic):
    out = tmp_path / f"live.{suffix}"
    assert main(["memory", str(CHAIN), "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left behind


def test_cli_network(tmp_path):
    out = tmp_path / "m.json"
    assert (
        main(["memory", "seed-lcn-small", "--batch", "8", "--ranks", "2", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["batch"] == 8 and result["forward_functions"] > 0
    assert result["peak_at"].endswith(".grad")


def _bad_dump(tmp_path) -> Path:
    path = tmp_path / "bad.txt"
    lines = CHAIN.read_text().splitlines()
    lines[13] = "4 gradient"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "0"], "--ranks must be at least 1, got 0"),
        (["--plot", "OUT.gif"], "unknown format"),
        (["--batch", "0"], "--batch must be at least 1"),
    ],
)
def test_cli_bad_options(tmp_path, capsys, args, message):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    json_out = tmp_path / "m.json"
    assert main(["memory", str(CHAIN), "--json", str(json_out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert list(tmp_path.iterdir()) == []


def test_cli_malformed_dump(tmp_path, capsys):
    bad = _bad_dump(tmp_path)
    json_out, plot_out = tmp_path / "m.json", tmp_path / "m.png"
    assert main(["memory", str(bad), "--json", str(json_out), "--plot", str(plot_out)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"legion-nn memory: {bad}:14: expected input 1 of 1 as 'ID _' (function 1 of 8, forward), got '4 gradient'\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_cli_subprocess_truncated_dump(tmp_path):
    cut = tmp_path / "cut.txt"
    cut.write_text("\n".join(CHAIN.read_text().splitlines()[:30]) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "legion_nn.cli", "memory", str(cut)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().startswith(f"legion-nn memory: {cut}:31: expected ")
    assert proc.stderr.strip().endswith("got end of file")
    assert proc.stderr.count("\n") == 1
