"""Peak-memory analysis: figures derived by hand for small dumps and graphs, the seed pinned, the CLI.

The hand derivations follow `legion_nn.memory`'s rules. Literal reading: a backward record that
lists v in any role, `gradient` included, keeps v's data alive until after it; so every function's
output lives until that function's backward.

chainer_chain.txt, batch 4 (label `1` is 16 bytes). Schedule: 0 LinearFunction-0, 1 ReLU-1,
2 LinearFunction-2, 3 SoftmaxCrossEntropy-3, 4 SoftmaxCrossEntropy-3.grad, 5 LinearFunction-2.grad,
6 ReLU-1.grad, 7 LinearFunction-0.grad. Always live: parameters 24+12+24+8 = 68, input 32, labels
16: 116. Lifetimes [first, last] and bytes:

    v4    [0,7] 48   read by ReLU-1, then listed `4 gradient` by LinearFunction-0.grad
    v5    [1,6] 48   LinearFunction-2.grad (input), ReLU-1.grad (gradient, output)
    v8    [2,5] 32   SoftmaxCrossEntropy-3.grad (input), LinearFunction-2.grad (gradient)
    v9    [3,4]  4   the loss, listed `9 gradient` by SoftmaxCrossEntropy-3.grad
    v9.grad [4,4] 4, v8.grad [4,5] 32, v1_1.grad [4,4] 16 (read by nothing), v5.grad [5,6] 48,
    v4.grad [6,7] 48, v0_0.grad [7,7] 32; fc2 grads [5,7] 24+8, fc1 grads [7,7] 24+12

    R=1  fn  resident + data              + gradients                    = live
         0   116 + 48                                                     = 164
         1   116 + 48+48                                                  = 212
         2   116 + 48+48+32                                               = 244
         3   116 + 48+48+32+4                                             = 248
         4   116 + 48+48+32+4             + 4+32+16                       = 300
         5   116 + 48+48+32               + 32+48+32(fc2)                 = 356  peak
         6   116 + 48+48                  + 48+32(fc2)+48                 = 340
         7   116 + 48                     + 48+32(fc2)+32+36(fc1)         = 312
    R=2  batch-carrying buffers halve; the 4-byte loss and its gradient and all parameter
         gradients do not; resident 68+16+8 = 92:
         0 92+24 = 116; 1 +24 = 140; 2 +16 = 156; 3 +4 = 160; 4 92+68+4+16+8 = 188;
         5 92+64+16+24+32 = 228 (peak); 6 92+48+32+24+24 = 220; 7 92+24+24+32+16+36 = 224
    R=4  quarter; resident 68+8+4 = 80:
         0 92; 1 104; 2 112; 3 116; 4 80+12+12+8+4+4+8+4 = 132; 5 80+32+8+12+32 = 164;
         6 80+24+12+32+12 = 160; 7 80+12+12+32+8+36 = 180 (peak, LinearFunction-0.grad)

chainer_branch.txt: v5 feeds two LinearFunctions of rank 2 (fc2 -> v8, fc3 -> v11) whose outputs
are added (v12). Schedule: 0 LinearFunction-0, 1 ReLU-1, 2 LinearFunction-2, 3 LinearFunction-2-2,
4 Add-3, 5 SoftmaxCrossEntropy-4, 6 its .grad, 7 Add-3.grad, 8 LinearFunction-2-2.grad (fc3's,
first in the file), 9 LinearFunction-2.grad, 10 ReLU-1.grad, 11 LinearFunction-0.grad. Resident:
parameters 100, input 32, labels 16: 148. v5's gradient is allocated by the first backward that
outputs it (8), accumulated by the second (9) and freed after ReLU-1.grad (10).

    v4 [0,11] 48, v5 [1,10] 48, v8 [2,9] 32, v11 [3,8] 32, v12 [4,7] 32, v13 (loss) [5,6] 4;
    v13.grad [6,6] 4, v12.grad [6,7] 32, v1_1.grad [6,6] 16, v8.grad [7,9] 32, v11.grad [7,8] 32,
    v5.grad [8,10] 48, v4.grad [10,11] 48, v0_0.grad [11,11] 32; fc3 grads [8,11] 32,
    fc2 grads [9,11] 32, fc1 grads [11,11] 36

    R=1  fn  resident + data                   + gradients                  = live
         0   148 + 48                                                       = 196
         1   148 + 48+48                                                    = 244
         2   148 + 48+48+32                                                 = 276
         3   148 + 48+48+32+32                                              = 308
         4   148 + 48+48+32+32+32                                           = 340
         5   148 + 48+48+32+32+32+4                                         = 344
         6   148 + 48+48+32+32+32+4           + 4+32+16                     = 396
         7   148 + 48+48+32+32+32             + 32+32+32                    = 436
         8   148 + 48+48+32+32                + 32+32+48+32(fc3)            = 452  peak
         9   148 + 48+48+32                   + 32+48+32(fc3)+32(fc2)       = 420
         10  148 + 48+48                      + 48+32+32+48                 = 404
         11  148 + 48                         + 32+32+48+32+36(fc1)         = 376
    R=2  halved, resident 124: 148, 172, 188, 204, 220, 224, 124+100+28 = 252, 124+96+48 = 268,
         124+80+88 = 292 (peak, first reached at 8), 124+64+104 = 292, 124+48+112 = 284,
         124+24+140 = 288
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
from legion_nn.importers.chainer_graph import tensor_name
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.memory import schedule_from_dump, schedule_from_graph
from legion_nn.rect import Rect

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SEED = FIXTURES / "chainer_vgg19_b32.txt"
CHAIN = FIXTURES / "chainer_chain.txt"
BRANCH = FIXTURES / "chainer_branch.txt"

SEED_PEAKS = {
    1: (5_109_010_624, "ReLU-35.grad"),
    2: (3_107_614_848, "ReLU-26.grad"),
    4: (2_107_306_080, "ReLU-26.grad"),
    8: (1_610_168_400, "Convolution2DFunction-25.grad"),
}
#: lowered vgg19 at batch 32: lower than the dump's (see test_lowered_vgg19_peaks)
LOWERED_VGG19_PEAKS = {
    1: (3_258_544_320, "conv4_4.filterNL.grad"),
    2: (2_182_770_816, "conv4_4.filterNL.grad"),
    4: (1_645_809_760, "conv3_4.filterNL.grad"),
    8: (1_392_922_704, "conv3_4.filterNL.grad"),
}


@pytest.mark.parametrize(
    "ranks, live, peak_at",
    [
        (1, [164, 212, 244, 248, 300, 356, 340, 312], "LinearFunction-2.grad"),
        (2, [116, 140, 156, 160, 188, 228, 220, 224], "LinearFunction-2.grad"),
        (4, [92, 104, 112, 116, 132, 164, 160, 180], "LinearFunction-0.grad"),
        (8, [92, 104, 112, 116, 132, 164, 160, 180], "LinearFunction-0.grad"),  # ceil(4/8) = 1
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
        (
            1,
            [196, 244, 276, 308, 340, 344, 396, 436, 452, 420, 404, 376],
            "LinearFunction-2-2.grad",
        ),
        (
            2,
            [148, 172, 188, 204, 220, 224, 252, 268, 292, 292, 284, 288],
            "LinearFunction-2-2.grad",
        ),
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
    lifetimes = {
        b.name: (names[b.first], names[b.last]) for b in schedule.buffers if b.name.startswith("v")
    }
    assert lifetimes["v5"] == ("ReLU-1", "ReLU-1.grad")
    # listed only in the gradient role by the backward of their producer, which keeps them alive
    assert lifetimes["v4"] == ("LinearFunction-0", "LinearFunction-0.grad")
    assert lifetimes["v8"] == ("LinearFunction-2", "LinearFunction-2.grad")
    assert lifetimes["v11"] == ("LinearFunction-2-2", "LinearFunction-2-2.grad")
    assert lifetimes["v13"] == ("SoftmaxCrossEntropy-4", "SoftmaxCrossEntropy-4.grad")


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


def test_imported_graph_frees_what_only_a_gradient_listing_keeps(seed_schedule):
    """The imported graph reads `v.grad`, not `v`, where a backward record lists `v gradient`, so
    under the any-role rule the dump keeps some variables longer. Exactly: every buffer has the same
    allocation, size and scaling in both; a produced variable's last function in the dump is the
    later of its last in the graph and its producer's backward; the only other difference is the
    4-byte loss gradient, counted in a dump and never materialised (an empty-rect read) in a
    graph."""
    dump = parse_dump(SEED)
    graph_schedule = schedule_from_graph(import_dump(dump))
    names = [s.name for s in seed_schedule.steps]
    assert [s.name for s in graph_schedule.steps] == names
    in_graph = {b.name: b for b in graph_schedule.buffers}
    producer = {tensor_name(dump, v): f for f in dump.forward for v in f.outputs}
    longer = []
    for b in seed_schedule.buffers:
        if b.name == "v62.grad":  # the loss gradient
            assert b.name not in in_graph and b.nbytes == 4
            continue
        g = in_graph.pop(b.name)
        assert (b.first, b.nbytes, b.scalable, b.param) == (g.first, g.nbytes, g.scalable, g.param)
        if b.name in producer:
            assert b.last == max(g.last, names.index(producer[b.name].name + ".grad"))
            if b.last != g.last:
                longer.append(producer[b.name].type)
        else:
            assert b.last == g.last
    assert not in_graph
    # the pre-activations (16 convolutions, fc6 and fc7 before their ReLUs), what feeds a
    # LinearFunction (the Reshape and Dropout outputs), the logits and the loss
    assert sorted(longer) == sorted(
        ["Convolution2DFunction"] * 16
        + ["LinearFunction"] * 3
        + ["Dropout"] * 2
        + ["Reshape", "SoftmaxCrossEntropy"]
    )
    # at R=1, the dump's peak holds the 16 convolution outputs that the graph has freed
    conv_outputs = sum(
        dump.variables[f.outputs[0]].nbytes
        for f in dump.forward
        if f.type == "Convolution2DFunction"
    )
    assert conv_outputs == 1_901_068_288
    at = names.index("ReLU-35.grad")
    assert seed_schedule.live_bytes(1)[at] - graph_schedule.live_bytes(1)[at] == conv_outputs


def test_lowered_vgg19_peaks(seed_schedule):
    """Lowered vgg19 at batch 32 has the seed's parameters but a lower peak than the seed dump.
    A Chainer backward record names the variable itself for its incoming gradient (`ID gradient`)
    and the any-role rule keeps that variable alive until then; a lowered graph names the gradient
    tensor (`output.delta` reads `<t>.grad`), so its pre-activations are freed after their ReLU.
    The lowered peaks are exactly those of the imported seed graph, which is read the same way,
    at the corresponding function (conv4_4.filterNL.grad is ReLU-26.grad, conv3_4's ReLU-17.grad);
    and at R=1 the dump's peak exceeds the lowered graph's live bytes at the same function
    (conv5_4.filterNL.grad, ReLU-35.grad) by exactly the 16 convolution outputs."""
    from legion_nn.networks import load_network

    schedule = schedule_from_graph(load_network("vgg19").lower(batch=32))
    imported = schedule_from_graph(import_dump(SEED))
    assert schedule.param_bytes == seed_schedule.param_bytes == 574_668_960
    for ranks, (peak, at) in LOWERED_VGG19_PEAKS.items():
        report = schedule.analyze(ranks)
        assert (report.peak_bytes, report.peak_step.name) == (peak, at)
        assert imported.analyze(ranks).peak_bytes == peak < SEED_PEAKS[ranks][0]
    at_relu35 = [s.name for s in schedule.steps].index("conv5_4.filterNL.grad")
    assert SEED_PEAKS[1] == (3_207_942_336 + 1_901_068_288, "ReLU-35.grad")
    assert schedule.live_bytes(1)[at_relu35] == 3_207_942_336


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
