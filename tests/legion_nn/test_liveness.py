"""Peak-memory analysis: figures derived by hand for small dumps and graphs, the seed pinned, the CLI.

The hand derivations follow `legion_nn.liveness`'s rule: v's data lives until the last function that
reads it as data (a forward function taking it as input, a backward record listing it as `input`
or `output`); a backward record listing `v gradient` reads v's gradient only. `_any_role` gives the
issue's first wording, where that listing also kept v's data alive, for comparison.

chainer_chain.txt, batch 4 (label `1` is 16 bytes). Schedule: 0 LinearFunction-0, 1 ReLU-1,
2 LinearFunction-2, 3 SoftmaxCrossEntropy-3, 4 SoftmaxCrossEntropy-3.grad, 5 LinearFunction-2.grad,
6 ReLU-1.grad, 7 LinearFunction-0.grad. Always live: parameters 24+12+24+8 = 68, input 32, labels
16: 116. Lifetimes [first, last] and bytes:

    v4    [0,1] 48   read by ReLU-1; LinearFunction-0.grad lists it only as `4 gradient`
    v5    [1,6] 48   LinearFunction-2.grad (input), ReLU-1.grad (output)
    v8    [2,4] 32   SoftmaxCrossEntropy-3.grad (input)
    v9    [3,3]  4   the loss, listed only as `9 gradient` after its producer
    v9.grad [4,4] 4, v8.grad [4,5] 32, v1_1.grad [4,4] 16 (read by nothing), v5.grad [5,6] 48,
    v4.grad [6,7] 48, v0_0.grad [7,7] 32; fc2 grads [5,7] 24+8, fc1 grads [7,7] 24+12

    R=1  fn  resident + data              + gradients                    = live
         0   116 + 48                                                     = 164
         1   116 + 48+48                                                  = 212
         2   116 + 48+32                                                  = 196
         3   116 + 48+32+4                                                = 200
         4   116 + 48+32                  + 4+32+16                       = 248
         5   116 + 48                     + 32+48+32(fc2)                 = 276
         6   116 + 48                     + 48+32(fc2)+48                 = 292  peak
         7   116                          + 48+32(fc2)+32+36(fc1)         = 264
    R=2  batch-carrying buffers halve; the 4-byte loss and its gradient and all parameter
         gradients do not; resident 68+16+8 = 92:
         0 92+24 = 116; 1 +24 = 140; 2 92+24+16 = 132; 3 +4 = 136; 4 92+40+4+16+8 = 160;
         5 92+24+16+24+32 = 188; 6 92+24+24+32+24 = 196; 7 92+24+32+16+36 = 200 (peak,
         LinearFunction-0.grad)
    R=4  quarter; resident 68+8+4 = 80:
         0 92; 1 104; 2 80+12+8 = 100; 3 104; 4 80+20+4+8+4 = 116; 5 80+12+8+12+32 = 144;
         6 80+12+12+32+12 = 148; 7 80+12+32+8+36 = 168 (peak, LinearFunction-0.grad)

chainer_branch.txt: v5 feeds two LinearFunctions of rank 2 (fc2 -> v8, fc3 -> v11) whose outputs
are added (v12). Schedule: 0 LinearFunction-0, 1 ReLU-1, 2 LinearFunction-2, 3 LinearFunction-2-2,
4 Add-3, 5 SoftmaxCrossEntropy-4, 6 its .grad, 7 Add-3.grad, 8 LinearFunction-2-2.grad (fc3's,
first in the file), 9 LinearFunction-2.grad, 10 ReLU-1.grad, 11 LinearFunction-0.grad. Resident:
parameters 100, input 32, labels 16: 148. v5's gradient is allocated by the first backward that
outputs it (8), accumulated by the second (9) and freed after ReLU-1.grad (10).

    v4 [0,1] 48, v5 [1,10] 48, v8 [2,4] 32 and v11 [3,4] 32 (read by Add-3, then only as
    gradients), v12 [4,6] 32, v13 (loss) [5,5] 4;
    v13.grad [6,6] 4, v12.grad [6,7] 32, v1_1.grad [6,6] 16, v8.grad [7,9] 32, v11.grad [7,8] 32,
    v5.grad [8,10] 48, v4.grad [10,11] 48, v0_0.grad [11,11] 32; fc3 grads [8,11] 32,
    fc2 grads [9,11] 32, fc1 grads [11,11] 36

    R=1  fn  resident + data                   + gradients                  = live
         0   148 + 48                                                       = 196
         1   148 + 48+48                                                    = 244
         2   148 + 48+32                                                    = 228
         3   148 + 48+32+32                                                 = 260
         4   148 + 48+32+32+32                                              = 292
         5   148 + 48+32+4                                                  = 232
         6   148 + 48+32                      + 4+32+16                     = 280
         7   148 + 48                         + 32+32+32                    = 292
         8   148 + 48                         + 32+32+48+32(fc3)            = 340
         9   148 + 48                         + 32+48+32(fc3)+32(fc2)       = 340
         10  148 + 48                         + 48+32+32+48                 = 356  peak
         11  148                              + 32+32+48+32+36(fc1)         = 328
    R=2  halved, resident 124: 148, 172, 164, 180, 196, 168, 124+40+28 = 192, 124+24+48 = 196,
         124+24+88 = 236, 124+24+104 = 252, 124+24+112 = 260, 124+140 = 264 (peak,
         LinearFunction-0.grad)
"""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.importers import import_dump, parse_dump
from legion_nn.importers.chainer import GRADIENT_ROLE, Dump
from legion_nn.importers.chainer_graph import tensor_name
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.liveness import Schedule, schedule_from_dump, schedule_from_graph
from legion_nn.rect import Rect
from tests.paths import FIXTURES, ROOT

SEED = FIXTURES / "chainer_vgg19_b32.txt"
CHAIN = FIXTURES / "chainer_chain.txt"
BRANCH = FIXTURES / "chainer_branch.txt"
CONVNET = FIXTURES / "chainer_convnet.txt"

#: the seed dump at batch 32; lowered vgg19 peaks at the corresponding functions with the same bytes
SEED_PEAKS = {
    1: (3_258_544_320, "ReLU-26.grad"),
    2: (2_182_770_816, "ReLU-26.grad"),
    4: (1_645_809_760, "ReLU-17.grad"),
    8: (1_392_922_704, "ReLU-17.grad"),
}
#: the same under the issue's first wording, "any role" (`_any_role`)
ANY_ROLE_SEED_PEAKS = {
    1: (5_109_010_624, "ReLU-35.grad"),
    2: (3_107_614_848, "ReLU-26.grad"),
    4: (2_107_306_080, "ReLU-26.grad"),
    8: (1_610_168_400, "Convolution2DFunction-25.grad"),
}
#: the dump's function and the lowered graph's task where the seed's peaks are reached
LOWERED_NAMES = {"ReLU-26.grad": "conv4_4.filterNL.grad", "ReLU-17.grad": "conv3_4.filterNL.grad"}


def _any_role(schedule: Schedule, dump: Dump) -> Schedule:
    """`schedule` under the issue's first wording: a backward record listing `v gradient` also
    keeps v's data alive until after it."""
    names = [s.name for s in schedule.steps]
    kept: dict[str, int] = {}
    for fn in dump.backward:
        for v in fn.ids(GRADIENT_ROLE):
            name = tensor_name(dump, v)
            kept[name] = max(kept.get(name, -1), names.index(fn.name))
    buffers = tuple(replace(b, last=max(b.last, kept.get(b.name, -1))) for b in schedule.buffers)
    return replace(schedule, buffers=buffers)


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
        (
            1,
            [196, 244, 228, 260, 292, 232, 280, 292, 340, 340, 356, 328],
            "ReLU-1.grad",
        ),
        (
            2,
            [148, 172, 164, 180, 196, 168, 192, 196, 236, 252, 260, 264],
            "LinearFunction-0.grad",
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
    assert lifetimes["v12"] == ("Add-3", "SoftmaxCrossEntropy-4.grad")
    # listed only in the gradient role after their last forward reader, which frees them
    assert lifetimes["v4"] == ("LinearFunction-0", "ReLU-1")
    assert lifetimes["v8"] == ("LinearFunction-2", "Add-3")
    assert lifetimes["v11"] == ("LinearFunction-2-2", "Add-3")
    assert lifetimes["v13"] == ("SoftmaxCrossEntropy-4", "SoftmaxCrossEntropy-4")


@pytest.mark.parametrize(
    "ranks, live, any_role",
    [
        (
            1,
            [580, 836, 644, 708, 732, 736, 768, 904, 880, 1072, 1200, 896],
            [580, 836, 900, 964, 988, 992, 1028, 1184, 1200, 1328, 1456, 1152],
        ),
        (
            2,
            [384, 512, 416, 448, 460, 464, 480, 600, 588, 684, 748, 636],
            [384, 512, 544, 576, 588, 592, 612, 740, 748, 812, 876, 764],
        ),
        (
            4,  # ceil(2/4) = 1 row per rank, as at R=2
            [384, 512, 416, 448, 460, 464, 480, 600, 588, 684, 748, 636],
            [384, 512, 544, 576, 588, 592, 612, 740, 748, 812, 876, 764],
        ),
    ],
)
def test_convnet_by_hand(ranks, live, any_role):
    """chainer_convnet.txt, batch 2 (label `1` is 8 bytes): VGG19's records in small, Convolution
    (1→2 channels, 3×3, pad 1, on 4×4), ReLU, MaxPooling 2×2, Reshape, Linear (8→3),
    SoftmaxCrossEntropy, each backward listing what the seed's does. Schedule: 0 Convolution2D-
    Function-0, 1 ReLU-1, 2 MaxPooling2D-2, 3 Reshape-3, 4 LinearFunction-4,
    5 SoftmaxCrossEntropy-5, then their backwards 6..11 in reverse (6 SoftmaxCrossEntropy-5.grad,
    ..., 10 ReLU-1.grad, 11 Convolution2DFunction-0.grad). Always live: parameters 72+8+96+12 = 188,
    input 128, labels 8: 324. Data [first, last], bytes, and its last reader:

        v4  [0,1]  256  conv output: ReLU-1; Convolution2DFunction-0.grad lists `4 gradient` only
        v5  [1,10] 256  ReLU output: MaxPooling2D-2.grad `5 input`, ReLU-1.grad `5 output`
        v6  [2,9]   64  pool output: Reshape-3.grad `6 input`, MaxPooling2D-2.grad `6 output`
        v7  [3,7]   64  LinearFunction-4.grad `7 input`
        v10 [4,6]   24  logits: SoftmaxCrossEntropy-5.grad `10 input`
        v11 [5,5]    4  the loss: only `11 gradient` lists it after its producer

    Gradients: v11.grad [6,6] 4, v10.grad [6,7] 24, v1_1.grad [6,6] 8 (read by nothing),
    v7.grad [7,8] 64, v6.grad [8,9] 64, v5.grad [9,10] 256, v4.grad [10,11] 256,
    v0_0.grad [11,11] 128; fc grads [7,11] 96+12 = 108, conv grads [11,11] 72+8 = 80.

        R=1  fn  resident + data            + gradients          = live
             0   324 + 256                                       = 580
             1   324 + 256+256                                   = 836
             2   324 + 256+64                                    = 644
             3   324 + 256+64+64                                 = 708
             4   324 + 256+64+64+24                              = 732
             5   324 + 256+64+64+24+4                            = 736
             6   324 + 256+64+64+24     + 4+24+8                 = 768
             7   324 + 256+64+64        + 24+64+108              = 904
             8   324 + 256+64           + 64+64+108              = 880
             9   324 + 256+64           + 64+256+108             = 1072
             10  324 + 256              + 256+256+108            = 1200  peak, ReLU-1.grad
             11  324                    + 256+128+108+80         = 896
        R=2  every batch-carrying buffer halves (not the 4-byte loss and its gradient, nor
             parameters and their gradients); resident 188+64+4 = 256:
             0 256+128 = 384; 1 +128 = 512; 2 256+128+32 = 416; 3 +32 = 448; 4 +12 = 460;
             5 +4 = 464; 6 256+204+(4+12+4) = 480; 7 256+192+(12+32+108) = 600;
             8 256+160+(32+32+108) = 588; 9 256+160+(32+128+108) = 684;
             10 256+128+(128+128+108) = 748 (peak, ReLU-1.grad); 11 256+(128+64+108+80) = 636

    Any role: v4 [0,11], v7 [3,8], v10 [4,7], v11 [5,6], so R=1 adds 256 from function 2 on, 4
    at 6, 24 at 7 and 64 at 8: peak 1456, not 1200; R=2 adds 128, 4, 12 and 32: 876, not 748.
    The graph imported from the dump reads the same, less the 4-byte loss gradient at 6."""
    dump = parse_dump(CONVNET)
    schedule = schedule_from_dump(dump)
    names = [s.name for s in schedule.steps]
    assert names[:6] == [
        "Convolution2DFunction-0",
        "ReLU-1",
        "MaxPooling2D-2",
        "Reshape-3",
        "LinearFunction-4",
        "SoftmaxCrossEntropy-5",
    ]
    assert names[6:] == [n + ".grad" for n in reversed(names[:6])]
    report = schedule.analyze(ranks)
    assert list(report.live) == live
    assert (report.peak_bytes, report.peak_step.name) == (max(live), "ReLU-1.grad")
    result = report.to_json()
    assert (result["param_bytes"], result["batch"]) == (188, 2)
    assert (result["forward_functions"], result["backward_functions"]) == (6, 6)
    old = _any_role(schedule, dump)
    assert old.live_bytes(ranks) == any_role
    assert old.analyze(ranks).peak_bytes > report.peak_bytes
    graph = schedule_from_graph(import_dump(dump)).live_bytes(ranks)
    assert graph == [n - 4 * (i == 6) for i, n in enumerate(live)]


def test_cli_convnet(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["memory", str(CONVNET), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["peak_bytes"], result["peak_at"]) == (1200, "ReLU-1.grad")
    assert "peak        1,200 bytes (1.17 KiB) per rank at ReLU-1.grad" in capsys.readouterr().out
    assert main(["memory", str(CONVNET), "--ranks", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["peak_bytes"] == 748


@pytest.mark.parametrize(
    "path, ranks, any_role",
    [
        # the hand derivations of these two fixtures under the first wording, as pinned before
        (CHAIN, 1, [164, 212, 244, 248, 300, 356, 340, 312]),
        (CHAIN, 2, [116, 140, 156, 160, 188, 228, 220, 224]),
        (CHAIN, 4, [92, 104, 112, 116, 132, 164, 160, 180]),
        (BRANCH, 1, [196, 244, 276, 308, 340, 344, 396, 436, 452, 420, 404, 376]),
        (BRANCH, 2, [148, 172, 188, 204, 220, 224, 252, 268, 292, 292, 284, 288]),
    ],
)
def test_any_role_by_hand(path, ranks, any_role):
    """`_any_role` reproduces the figures derived by hand under the first wording, which are never
    below the rule's, function by function, and above it at the peak."""
    dump = parse_dump(path)
    schedule = schedule_from_dump(dump)
    old = _any_role(schedule, dump)
    assert old.live_bytes(ranks) == any_role
    assert all(o >= n for o, n in zip(any_role, schedule.live_bytes(ranks)))
    assert old.analyze(ranks).peak_bytes > schedule.analyze(ranks).peak_bytes


@pytest.fixture(scope="module")
def seed_dump():
    return parse_dump(SEED)


@pytest.fixture(scope="module")
def seed_schedule(seed_dump):
    return schedule_from_dump(seed_dump)


@pytest.mark.parametrize("ranks", sorted(SEED_PEAKS))
def test_seed_peaks(seed_schedule, ranks):
    report = seed_schedule.analyze(ranks)
    assert (report.peak_bytes, report.peak_step.name) == SEED_PEAKS[ranks]
    result = report.to_json()
    assert result["param_bytes"] == 574_668_960
    assert (result["forward_functions"], result["backward_functions"]) == (46, 46)


def test_seed_against_any_role(seed_dump, seed_schedule):
    """Under the first wording every forward output listed as `ID gradient` lived until its
    producer's backward: the pre-activations (16 convolutions, fc6 and fc7 before their ReLUs), what
    feeds a LinearFunction (the Reshape and Dropout outputs), the logits and the loss. The rule
    frees them after their last reader, so no function holds more than before, and at the old
    R=1 peak, ReLU-35.grad, exactly the 16 convolution outputs less."""
    dump, schedule = seed_dump, seed_schedule
    old = _any_role(schedule, dump)
    producer = {tensor_name(dump, v): f for f in dump.forward for v in f.outputs}
    longer = [
        producer[b.name].type for b, o in zip(schedule.buffers, old.buffers) if b.last != o.last
    ]
    assert sorted(longer) == sorted(
        ["Convolution2DFunction"] * 16
        + ["LinearFunction"] * 3
        + ["Dropout"] * 2
        + ["Reshape", "SoftmaxCrossEntropy"]
    )
    for ranks, (peak, at) in ANY_ROLE_SEED_PEAKS.items():
        report = old.analyze(ranks)
        assert (report.peak_bytes, report.peak_step.name) == (peak, at)
        assert all(o >= n for o, n in zip(report.live, schedule.live_bytes(ranks)))
        assert SEED_PEAKS[ranks][0] < peak
    conv_outputs = sum(
        dump.variables[f.outputs[0]].nbytes
        for f in dump.forward
        if f.type == "Convolution2DFunction"
    )
    assert conv_outputs == 1_901_068_288
    at = [s.name for s in schedule.steps].index("ReLU-35.grad")
    assert old.live_bytes(1)[at] - schedule.live_bytes(1)[at] == conv_outputs


def test_imported_graph_follows_the_dump_rule(seed_dump, seed_schedule):
    """The imported graph reads `v.grad` where a backward record lists `v gradient` and `v` where
    it lists `v input` or `v output`, the dump's rule: every buffer has the same allocation, last
    function, size and scaling in both, but the 4-byte loss gradient, counted in a dump and never
    materialised (an empty-rect read) in a graph; so live bytes agree at every function but the
    loss's backward, and the peaks agree."""
    graph_schedule = schedule_from_graph(import_dump(seed_dump))
    names = [s.name for s in seed_schedule.steps]
    assert [s.name for s in graph_schedule.steps] == names
    in_graph = {b.name: b for b in graph_schedule.buffers}
    for b in seed_schedule.buffers:
        if b.name == "v62.grad":  # the loss gradient
            assert b.name not in in_graph and b.nbytes == 4
            continue
        assert b == in_graph.pop(b.name)
    assert not in_graph
    loss_grad = names.index("SoftmaxCrossEntropy-45.grad")
    for ranks in SEED_PEAKS:
        dump_live, graph_live = seed_schedule.live_bytes(ranks), graph_schedule.live_bytes(ranks)
        assert [d - g for d, g in zip(dump_live, graph_live)] == [
            4 * (i == loss_grad) for i in range(len(names))
        ]
        assert graph_schedule.analyze(ranks).peak_bytes == SEED_PEAKS[ranks][0]


def test_lowered_vgg19_agrees_with_the_dump(seed_dump, seed_schedule):
    """Lowered vgg19 at batch 32 has the seed's parameters and, under the one rule, the seed's
    peaks (and evaluate's sums) at the corresponding functions (ReLU-26.grad is conv4_4.filterNL.grad, ReLU-17.grad
    conv3_4's). Over the convolutional trunk, conv1_1 to pool5 forward and back (74 functions in
    each), live bytes agree function by function at every R but at six, where the dump's
    functions read more: each MaxPooling2D backward lists its output (`ID output`; lowered
    `maxpool.grad` reads its input and the gradient only), which lives there by the output's
    bytes, and the first convolution's backward outputs the image's gradient, which a lowered
    graph never computes."""
    from legion_nn.networks import load_network

    dump = seed_dump
    lowered = schedule_from_graph(load_network("vgg19").lower(batch=32))
    assert lowered.param_bytes == seed_schedule.param_bytes == 574_668_960
    # the lowered step also holds evaluate's four float64 sums from the forward to its end,
    # where the accuracy reads them (the seed's dump has no such tensor)
    statistics = 4 * 8
    for ranks, (peak, at) in SEED_PEAKS.items():
        report = lowered.analyze(ranks)
        assert (report.peak_bytes, report.peak_step.name) == (peak + statistics, LOWERED_NAMES[at])

    def trunk(schedule, forward, end, backward):
        names = [s.name for s in schedule.steps]
        backward_on = names[names.index(backward) :]
        # the lowered step's accuracy, which writes nothing, runs after the backward
        backward_on = [n for n in backward_on if not n.endswith(".accuracy")]
        return names[names.index(forward) : names.index(end)] + backward_on

    in_dump = trunk(seed_schedule, "Convolution2DFunction-0", "Reshape-37", "MaxPooling2D-36.grad")
    in_lowered = trunk(lowered, "conv1_1.conv", "fc6.linear1", "pool5.maxpool.grad")
    assert len(in_dump) == len(in_lowered) == 74
    kinds = {"Convolution2DFunction": ".conv", "ReLU": ".filterNL", "MaxPooling2D": ".maxpool"}
    functions = {f.name: f for f in dump.functions}
    for d, g in zip(in_dump, in_lowered):
        assert g.removesuffix(".grad").endswith(kinds[functions[d].type])
        assert d.endswith(".grad") == g.endswith(".grad")
    buffers = {b.name: b for b in seed_schedule.buffers}
    image_grad = tensor_name(dump, functions["Convolution2DFunction-0"].ids()[0]) + ".grad"
    for ranks in SEED_PEAKS:
        at_dump = dict(zip((s.name for s in seed_schedule.steps), seed_schedule.live_bytes(ranks)))
        at_lowered = dict(zip((s.name for s in lowered.steps), lowered.live_bytes(ranks)))
        # evaluate's sums are live in the lowered step's whole backward
        more = {
            d: at_dump[d] - at_lowered[g] + (statistics if g.endswith(".grad") else 0)
            for d, g in zip(in_dump, in_lowered)
        }
        expected = {
            f.name: buffers[tensor_name(dump, v)].bytes_per_rank(32, ranks)
            for f in dump.backward
            if f.type == "MaxPooling2D"
            for v in f.ids("output")
        }
        expected["Convolution2DFunction-0.grad"] = buffers[image_grad].bytes_per_rank(32, ranks)
        assert {d: n for d, n in more.items() if n} == expected


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
        [sys.executable, "-m", "cli", "memory", str(cut)],
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
