"""`legion-nn graph seed-lcn --batch 256` against a clean transcription of seed 000."""

import json

import pytest

from cli.main import main
from legion_nn.rect import Rect
from tests.paths import FIXTURES

FIXTURE = FIXTURES / "seed_000_transcription.json"
SEED = json.loads(FIXTURE.read_text())


def rect_text(rect):
    if rect is None:
        return "None"
    return repr(Rect(tuple(rect[0]), tuple(rect[1])))


def dims_text(dims):
    return "[" + " ".join(str(d) for d in dims) + "]"


def parse_text_form(text):
    """Blocks of the text form: {("task"|"tensor", name): {"fields": {...}, "edges": [...]}}."""
    blocks = {}
    for chunk in text.strip().split("\n\n"):
        lines = [line for line in chunk.splitlines() if not line.startswith("#")]
        if not lines:
            continue
        kind, name = lines[0].split(" ", 1)
        fields, edges = {}, []
        for line in lines[1:]:
            line = line.strip()
            if "->" in line:
                edges.append(line)
            else:
                for part in line.split(" ") if line.startswith(("op=", "kind=")) else [line]:
                    key, value = part.split("=", 1)
                    fields[key] = value
        assert (kind, name) not in blocks, f"{kind} {name} shown twice"
        blocks[(kind, name)] = {"fields": fields, "edges": edges}
    return blocks


@pytest.fixture(scope="module")
def seed_text(tmp_path_factory, capsys_module=None):
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    json_path = tmp_path_factory.mktemp("seed") / "seed.json"
    with redirect_stdout(out):
        assert (
            main(["graph", "seed-lcn", "--batch", "256", "--text", "--json", str(json_path)]) == 0
        )
    return parse_text_form(out.getvalue()), json.loads(json_path.read_text())


def test_every_seed_task_is_reproduced(seed_text):
    blocks, _ = seed_text
    for name, expected in SEED["tasks"].items():
        block = blocks.get(("task", name))
        assert block is not None, f"task {name} missing"
        if "result_dim" in expected:
            assert block["fields"]["result_dim"] == dims_text(expected["result_dim"]), name
        for role, rect in expected.get("dist", {}).items():
            assert block["fields"][f"dist_{role}"] == rect_text(rect), f"{name} dist_{role}"


def test_every_seed_tensor_is_reproduced(seed_text):
    blocks, _ = seed_text
    differences = SEED["known_differences"]
    for name, expected in SEED["tensors"].items():
        block = blocks.get(("tensor", name))
        assert block is not None, f"tensor {name} missing"
        assert block["fields"]["dim"] == dims_text(expected["dim"]), name
        for key in ("read_rect", "write_rect"):
            got = block["fields"][key]
            if f"tensors.{name}.{key}" in differences:
                assert got != rect_text(expected[key]), f"documented difference gone: {name}"
                continue
            assert got == rect_text(expected[key]), f"{name} {key}"


def test_the_documented_difference_is_as_documented(seed_text):
    blocks, _ = seed_text
    assert blocks[("tensor", "classifier.softmax.output")]["fields"]["read_rect"] == "None"


def test_every_seed_edge_is_reproduced(seed_text):
    blocks, _ = seed_text
    for src, label, dst in SEED["edges"]:
        if label.startswith("->"):  # tensor -> task: a read, listed on the task
            assert f"{src} {label}" in blocks[("task", dst)]["edges"], f"{src} {label} {dst}"
        else:  # task -> tensor: a write
            assert f"{label} {dst}" in blocks[("task", src)]["edges"], f"{src} {label} {dst}"


def test_json_export_carries_the_same_edges(seed_text):
    _, data = seed_text
    assert data["format"] == "legion-nn/taskgraph-v1"
    assert data["network"] == "seed-lcn" and data["batch"] == 256
    tasks = {t["name"]: t for t in data["tasks"]}
    for src, label, dst in SEED["edges"]:
        if label.startswith("->"):
            reqs = [r for r in tasks[dst]["requirements"] if r["tensor"] == src]
            assert any(r["role"] == label[2:] and r["read_rect"] is not None for r in reqs)
        else:
            reqs = [r for r in tasks[src]["requirements"] if r["tensor"] == dst]
            assert any(r["role"] == label[:-2] and r["write_rect"] is not None for r in reqs)
    dims = {t["name"]: t["dims"] for t in data["tensors"]}
    for name, expected in SEED["tensors"].items():
        assert dims[name] == expected["dim"]
    kinds = {t["name"]: t["kind"] for t in data["tensors"]}
    assert kinds["L0.W"] == "param" and kinds["L0.W.grad"] == "grad"
    assert kinds["data.raw_output"] == "data" and kinds["L0.filter.output"] == "activation"
