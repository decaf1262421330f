"""`legion-nn render` and `visualize.dot`: the seed in full, layer views, inputs that must fail."""

import xml.etree.ElementTree as ET

import graphviz
import pytest

from cli.main import main
from legion_nn.networks import load_network
from legion_nn.rect import Rect
from tests.paths import FIXTURES
from visualize.dot import forward_only, rect_text, to_graphviz
from visualize.layers import layer_view

SVG = "{http://www.w3.org/2000/svg}"


def svg_parts(path):
    """(node titles, edge texts, edge dash flags by text) of a dot-made SVG."""
    root = ET.parse(path).getroot()
    nodes, edges = [], []
    for group in root.iter(f"{SVG}g"):
        kind = group.get("class")
        if kind not in ("node", "edge"):
            continue
        title = group.find(f"{SVG}title").text
        if kind == "node":
            nodes.append(title)
        else:
            text = " ".join(t.text for t in group.iter(f"{SVG}text") if t.text)
            dashed = any(p.get("stroke-dasharray") for p in group.iter(f"{SVG}path"))
            edges.append((text, dashed))
    return nodes, edges


def render(tmp_path, *args, name="out.svg"):
    out = tmp_path / name
    return main(["render", *args, "-o", str(out)]), out


@pytest.fixture(scope="module")
def seed_graph():
    return load_network("seed-lcn").lower(batch=256)


@pytest.fixture(scope="module")
def seed_svg(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "seed.svg"
    # the seed is a plain SGD step: no optimizer state
    assert main(["render", "seed-lcn", "--batch", "256", "--optimizer", "sgd", "-o", str(out)]) == 0
    return svg_parts(out)


def test_seed_has_one_node_per_task_and_tensor(seed_svg, seed_graph):
    nodes, _ = seed_svg
    expected = {f"task/{t.name}" for t in seed_graph.tasks}
    expected |= {f"tensor/{name}" for name in seed_graph.tensors}
    assert len(nodes) == len(expected) == 43 + 34
    assert set(nodes) == expected


def test_seed_edges_carry_the_seed_role_labels(seed_svg, seed_graph):
    _, edges = seed_svg
    texts = [text for text, _ in edges]
    for label in ("->input", "output->", "filters.delta-> (+)", "->gradient", "->params"):
        assert label in texts, label
    assert len(edges) == sum(len(t.requirements) for t in seed_graph.tasks)


def test_reductions_are_dashed_and_the_rest_solid(seed_svg):
    _, edges = seed_svg
    assert edges
    for text, dashed in edges:
        assert dashed == text.endswith("(+)"), text


def test_labels_show_dims_and_compact_rects(seed_graph):
    source = to_graphviz(seed_graph).source
    assert "dim=[64 1 1 1 9 9 33 33]" in source
    assert "read_rect=0..[256 1 41 41]" in source
    assert "write_rect=None" in source
    assert "dist_filters=0..[64 1 1 64 7 7 27 27]" in source
    assert "result_dim=[256 64 33 33]" in source
    seed_form = to_graphviz(seed_graph, rects="seed").source
    assert "Rect(array([0, 0, 0, 0], dtype=int32), array([256, 1, 41, 41], dtype=int32))" in (
        seed_form
    )


def test_rect_text():
    assert rect_text(Rect((0, 0), (256, 41))) == "0..[256 41]"
    assert rect_text(Rect((64, 0), (128, 41))) == "[64 0]..[128 41]"
    assert rect_text(Rect.empty(4)) == "empty"
    assert rect_text(None) == "None"


def test_to_graphviz_is_pure(seed_graph, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dot = to_graphviz(seed_graph, rankdir="LR")
    assert isinstance(dot, graphviz.Digraph)
    assert "rankdir=LR" in dot.source
    assert list(tmp_path.iterdir()) == []


def test_forward_only_has_no_backward_or_update_nodes(tmp_path, seed_graph):
    status, out = render(tmp_path, "seed-lcn", "--forward-only")
    assert status == 0
    nodes, edges = svg_parts(out)
    forward = forward_only(seed_graph)
    assert {t.phase for t in forward.tasks} == {"forward", "set_zero"}
    assert set(nodes) == {f"task/{t.name}" for t in forward.tasks} | {
        f"tensor/{name}" for name in forward.tensors
    }
    assert not [n for n in nodes if ".grad" in n or n.startswith("task/update_")]
    assert "->gradient" not in [text for text, _ in edges]


def test_vgg19_collapses_to_one_node_per_layer(tmp_path):
    status, out = render(tmp_path, "vgg19", "--batch", "32", "--collapse", "layer")
    assert status == 0
    nodes, edges = svg_parts(out)
    layers = {t.layer for t in load_network("vgg19").lower(batch=32).tasks}
    assert len(layers) == 25
    assert sorted(nodes) == sorted(f"layer/{name}" for name in layers)
    assert all(text.strip().endswith(("B", "KiB", "MiB", "GiB")) for text, _ in edges)


def test_vgg19_full_view_still_lays_out(tmp_path):
    # Unbounded, dot spent over ten minutes on this layout.
    status, out = render(tmp_path, "vgg19", "--batch", "32", "--collapse", "none")
    assert status == 0
    assert len(svg_parts(out)[0]) == 216 + 170 + 2 * 38  # Adam's two moments of 38 parameters


def test_max_nodes_picks_the_layer_view(tmp_path, capsys):
    status, out = render(tmp_path, "seed-lcn", "--max-nodes", "50")
    assert status == 0
    nodes, _ = svg_parts(out)
    assert sorted(nodes) == ["layer/L0", "layer/L1", "layer/classifier", "layer/data"]
    assert "more than --max-nodes 50" in capsys.readouterr().err
    status, out = render(tmp_path, "seed-lcn", "--max-nodes", "50", "--collapse", "none")
    assert len(svg_parts(out)[0]) == 77 + 2 * 7  # the seed's, and Adam's moments of 7 parameters


def test_layer_flows_run_down_forward_and_up_backward(seed_graph):
    view = layer_view(seed_graph)
    assert [layer.name for layer in view.layers] == ["data", "L0", "L1", "classifier"]
    flows = {(f.src, f.dst, f.phase): f for f in view.flows}
    assert flows[("data", "classifier", "forward")].tensors == ("data.labels_output",)
    assert flows[("L0", "L1", "forward")].nbytes == 256 * 64 * 33 * 33 * 4
    assert flows[("L1", "L0", "backward")].tensors == ("L0.filterNL.output.grad",)
    assert all(f.phase in ("forward", "backward") for f in view.flows)


def test_a_graph_json_renders(tmp_path):
    graph_json = tmp_path / "seed-small.json"
    assert main(["graph", "seed-lcn-small", "--batch", "8", "--json", str(graph_json)]) == 0
    status, out = render(tmp_path, str(graph_json))
    assert status == 0
    nodes, _ = svg_parts(out)
    assert "task/L0.filter.grad" in nodes and "tensor/L1.W.grad" in nodes
    status, dot = render(tmp_path, str(graph_json), name="g.dot")
    assert status == 0
    assert dot.read_text().startswith("digraph ")


def test_without_dot_the_source_is_written_with_an_install_hint(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    status, out = render(tmp_path, "seed-lcn-small", name="g.svg")
    err = capsys.readouterr().err
    assert status == 2
    assert not out.exists()
    assert (tmp_path / "g.dot").read_text().startswith("digraph ")
    assert "apt-get install graphviz" in err and len(err.strip().splitlines()) == 1
    status, out = render(tmp_path, "seed-lcn-small", name="h.dot")
    assert status == 0 and out.exists()


def corrupt_graph(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "legion-nn/taskgraph-v1", "tensors": []}')
    return path


def unparseable_graph(tmp_path):
    path = tmp_path / "garbled.json"
    path.write_text('{"format": "legion-nn/taskgraph-v1",\n "tasks": [}')
    return path


@pytest.mark.parametrize(
    "source, name, message",
    [
        ("no-such-net", "out.svg", "unknown network 'no-such-net'"),
        ("seed-lcn-small", "out.jpg", "unknown format; give a file ending in .svg"),
        ("seed-lcn-small", "missing/out.svg", "no such directory"),
        (corrupt_graph, "out.svg", "broken.json: top level: missing key 'tasks'"),
        (unparseable_graph, "out.svg", "garbled.json:2: not valid JSON"),
    ],
    ids=["unknown-network", "bad-suffix", "missing-dir", "corrupt-graph-json", "unparseable-json"],
)
def test_bad_inputs_fail_with_one_line_and_no_file(tmp_path, capsys, source, name, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    if callable(source):
        source = str(source(tmp_path))
    status, _ = render(out_dir, source, name=name)
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert list(out_dir.iterdir()) == []


def test_a_chainer_dump_renders_and_exports(tmp_path):
    """Imported graphs render and export like lowered ones (issue 4)."""
    from legion_nn.graphjson import load_graph
    from legion_nn.verify import verify

    dump = FIXTURES / "chainer_chain.txt"
    out = tmp_path / "chain.dot"
    assert main(["render", str(dump), "-o", str(out)]) == 0
    text = out.read_text()
    exported = tmp_path / "chain.json"
    assert main(["graph", str(dump), "--json", str(exported)]) == 0
    graph = load_graph(exported)
    verify(graph)
    assert any(t.phase == "backward" for t in graph.tasks)
    for task in graph.tasks:
        assert task.name in text, task.name
