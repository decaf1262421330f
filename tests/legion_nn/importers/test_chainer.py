"""The Chainer dump parser and importer: the seed, two small hand-written dumps, and bad input."""

import pytest

from legion_nn.errors import LegionNNError
from legion_nn.importers import import_dump, parse_dump
from legion_nn.importers.chainer import parse_dump_text
from legion_nn.importers.chainer_graph import tensor_name
from legion_nn.privilege import Privilege
from legion_nn.verify import verify
from tests.paths import FIXTURES

SEED = FIXTURES / "chainer_vgg19_b32.txt"
CHAIN = FIXTURES / "chainer_chain.txt"
BRANCH = FIXTURES / "chainer_branch.txt"


@pytest.fixture(scope="module")
def seed():
    return parse_dump(SEED)


def test_seed_counts(seed):
    assert len(seed.variables) == 86
    assert len(seed.forward) == 46
    assert len(seed.backward) == 46
    assert seed.param_bytes == 574_668_960
    assert seed.batch() == 32
    assert seed.batch(override=8) == 8


def test_seed_pairs_every_backward_with_its_forward(seed):
    for fn in seed.backward:
        partner = seed.functions[fn.partner]
        assert (partner.direction, partner.type, partner.rank) == ("forward", fn.type, fn.rank)
        assert fn.name == partner.name + ".grad"
        assert set(fn.outputs) <= set(partner.ids())
    assert len({fn.partner for fn in seed.backward}) == 46


def test_seed_schedule_is_forward_ascending_then_backward_descending(seed):
    schedule = seed.schedule()
    assert [f.rank for f in schedule] == list(range(46)) + list(range(45, -1, -1))
    assert schedule[0].name == "Convolution2DFunction-0"
    assert schedule[45].name == "SoftmaxCrossEntropy-45"
    assert schedule[46].name == "SoftmaxCrossEntropy-45.grad"


def test_seed_imports_with_shapes_and_verifies(seed):
    graph = import_dump(seed)
    verify(graph)
    t = graph.tensors
    assert graph.batch == 32
    assert t["v79_0"].dims == (32, 3, 224, 224) and t["v79_0"].kind == "data"
    assert t["v80_1"].dims == (32,) and t["v80_1"].dtype == "int32"
    assert t["/predictor/conv1_1/W"].dims == (64, 3, 3, 3)
    assert t["/predictor/fc6/W"].dims == (4096, 25088)
    assert t["v8"].dims == (32, 25088)  # the Reshape before fc6
    assert t["v62"].dims == (1,)  # the loss
    params = [x for x in t.values() if x.kind == "param"]
    assert len(params) == 38 and sum(x.nbytes for x in params) == 574_668_960
    for var in seed.variables.values():
        tensor = t[tensor_name(seed, var.id)]
        assert tensor.nbytes == var.nbytes
        batchy = not var.is_param and var.nbytes % 32 == 0 and var.nbytes > 4
        assert (tensor.dims[0] == 32) == batchy, tensor
    phases = [task.phase for task in graph.tasks if task.phase != "set_zero"]
    assert phases == ["forward"] * 46 + ["backward"] * 46


def test_chain_import_roles_and_privileges():
    graph = import_dump(CHAIN)
    verify(graph)
    names = [task.name for task in graph.tasks]
    assert names[:5] == [
        "LinearFunction-0",
        "ReLU-1",
        "LinearFunction-2",
        "v9.set_zero",  # the loss is a sum over the batch: zeroed, then reduced into
        "SoftmaxCrossEntropy-3",
    ]
    assert graph.tensors["v9"].kind == "stat"
    assert graph.task("SoftmaxCrossEntropy-3").requirement("output").privilege is Privilege.REDUCE
    # every gradient is zeroed right before the first task touching it
    assert names.index("v5.grad.set_zero") == names.index("LinearFunction-2.grad") - 3
    fc2 = graph.task("LinearFunction-2.grad")
    got = {(r.role, r.tensor, r.privilege) for r in fc2.requirements}
    assert got == {
        ("output.delta", "v8.grad", Privilege.READ),
        ("input", "v5", Privilege.READ),
        ("weights", "/fc2/W", Privilege.READ),
        ("b", "/fc2/b", Privilege.READ),
        ("input.delta", "v5.grad", Privilege.REDUCE),
        ("weights.delta", "/fc2/W.grad", Privilege.REDUCE),
        ("b.delta", "/fc2/b.grad", Privilege.REDUCE),
    }
    loss = graph.task("SoftmaxCrossEntropy-3.grad").requirement("output.delta")
    assert loss.tensor == "v9.grad" and loss.read_rect.is_empty()  # one, never materialised
    assert graph.tensors["/fc1/W"].dims == (3, 2) and graph.tensors["v0_0"].dims == (4, 2)


def test_branch_gradient_is_accumulated():
    dump = parse_dump(BRANCH)
    # the two LinearFunctions of rank 2 pair by content, not by file order
    fc2, fc3 = (f for f in dump.forward if f.type == "LinearFunction" and f.rank == 2)
    assert (fc2.name, fc3.name) == ("LinearFunction-2", "LinearFunction-2-2")
    by_name = {f.name: f for f in dump.backward}
    assert by_name["LinearFunction-2.grad"].ids("gradient") == [8]
    assert by_name["LinearFunction-2-2.grad"].ids("gradient") == [11]

    graph = import_dump(dump)
    verify(graph)
    writers = [
        (task.name, req.privilege)
        for task in graph.tasks
        for req in task.requirements
        if req.tensor == "v5.grad" and req.write_rect is not None
    ]
    assert writers == [
        ("v5.grad.set_zero", Privilege.WRITE),
        ("LinearFunction-2-2.grad", Privilege.REDUCE),
        ("LinearFunction-2.grad", Privilege.REDUCE),
    ]
    assert [t.name for t in graph.consumers("v5.grad")] == ["ReLU-1.grad"]
    deps = {(d.src, d.dst) for d in graph.dependences if d.tensor == "v5.grad"}
    assert ("LinearFunction-2.grad", "ReLU-1.grad") in deps
    assert ("LinearFunction-2-2.grad", "ReLU-1.grad") in deps


def test_text_and_path_parse_alike():
    text = CHAIN.read_text()
    assert parse_dump(text).functions == parse_dump(CHAIN).functions
    assert parse_dump(text).source == "<dump>"


def test_batch_needs_a_label_or_an_override():
    text = CHAIN.read_text().replace("1 16 1\n", "1 16 _\n")
    with pytest.raises(LegionNNError, match="no label variable named `1`.*--batch"):
        parse_dump(text).batch()
    assert import_dump(parse_dump(text), batch=4).batch == 4


def _lines() -> list[str]:
    return CHAIN.read_text().splitlines()


def _replace(number: int, line: str) -> str:
    lines = _lines()
    lines[number - 1] = line
    return "\n".join(lines) + "\n"


# (line number, replacement, what the message must say); line numbers are those of chainer_chain.txt
MALFORMED = [
    (1, "10", "expected 'VARIABLES FUNCTIONS' (two counts), got '10'"),
    (1, "10 x", "expected 'VARIABLES FUNCTIONS'"),
    (6, "4 48", "expected variable 5 of 10 as 'ID BYTES NAME', got '4 48'"),
    (6, "4 -48 _", "expected variable 5 of 10"),
    (6, "3 48 _", "expected a new variable id, got id 3 again (first on line 5)"),
    (12, "forwards", "expected 'forward' or 'backward' (function 1 of 8), got 'forwards'"),
    (13, "1", "expected 'INPUTS OUTPUTS' (two counts, function 1 of 8)"),
    (14, "4 gradient", "expected input 1 of 1 as 'ID _' (function 1 of 8, forward)"),
    (14, "99 _", "expected the id of a declared variable, got id 99"),
    (15, "5 6", "expected output 1 of 1 as 'ID' (function 1 of 8)"),
    (16, "Re LU", "expected the function type, one word (function 1 of 8)"),
    (17, "{rank: 1}", 'expected a JSON object of attributes with an integer "rank"'),
    (17, '{"rank": "1"}', 'got rank "1"'),
    (17, "[1]", "got a JSON list"),
    (17, "", "got an empty line"),
    (
        43,
        "8 grad",
        "expected input 1 of 4 as 'ID gradient|input|output' (function 5 of 8, backward)",
    ),
]


@pytest.mark.parametrize("number, line, message", MALFORMED)
def test_malformed_line_names_its_number(number, line, message):
    with pytest.raises(LegionNNError) as info:
        parse_dump_text(_replace(number, line), "bad.txt")
    assert str(info.value).startswith(f"bad.txt:{number}: expected ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keep", [0, 1, 5, 11, 12, 14, 16, 17, 50, len(_lines()) - 1])
def test_truncated_dump_names_the_line_after_its_last(keep):
    text = "\n".join(_lines()[:keep])
    with pytest.raises(LegionNNError) as info:
        parse_dump_text(text, "cut.txt")
    assert str(info.value).startswith(f"cut.txt:{keep + 1}: expected ")
    assert str(info.value).endswith("got end of file")


def test_trailing_garbage_and_unmatched_backward():
    with pytest.raises(LegionNNError, match=r"^x:79: expected end of file after the 8 functions"):
        parse_dump_text(CHAIN.read_text() + "forward\n", "x")
    assert parse_dump_text(CHAIN.read_text() + "\n\n", "x")  # trailing blank lines are fine
    text = _replace(50, "LinearFunctionX")  # the type of the first backward record
    with pytest.raises(LegionNNError, match=r"^x:41: expected the backward of a forward"):
        parse_dump_text(text, "x")


def test_binary_file_is_a_clear_error(tmp_path):
    path = tmp_path / "dump.bin"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(LegionNNError, match="not UTF-8 text"):
        parse_dump(path)
