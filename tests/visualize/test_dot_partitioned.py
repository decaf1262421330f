"""`legion-nn render --ranks R --strategy S`: a cluster per rank, messages drawn between them."""

import json
import xml.etree.ElementTree as ET
from collections import Counter

import graphviz
import pytest

from cli.main import main
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from tests.paths import FIXTURES
from visualize.dot import bytes_text, forward_only, rect_text
from visualize.partition_dot import partition_graphviz
from visualize.piece_view import collapse_by_unit, piece_id, piece_view

SVG = "{http://www.w3.org/2000/svg}"


def svg_graph(path):
    """(cluster titles, node titles, {(tail, head): [edge texts]}) of a dot-made SVG."""
    root = ET.parse(path).getroot()
    clusters, nodes, edges = [], [], {}
    for group in root.iter(f"{SVG}g"):
        kind = group.get("class")
        title = group.find(f"{SVG}title")
        if kind == "cluster":
            clusters.append(title.text)
        elif kind == "node":
            nodes.append(title.text)
        elif kind == "edge":
            tail, head = title.text.split("->")
            text = " ".join(t.text for t in group.iter(f"{SVG}text") if t.text)
            edges.setdefault((tail, head), []).append(text)
    return clusters, nodes, edges


def node(name, rank):
    return f"piece/{piece_id(name, rank)}"


@pytest.fixture(scope="module")
def small():
    return load_network("seed-lcn-small").lower(batch=8)


def plan_for(graph, strategy, nranks=4):
    return build_plan(graph, builtin(graph, strategy, nranks), nranks)


def task_plan(plan, name):
    return next(t for t in plan.tasks if t.task == name)


@pytest.mark.parametrize("strategy", ["data", "spatial"])
def test_svg_has_a_cluster_per_rank_and_labelled_cross_rank_edges(tmp_path, small, strategy):
    out = tmp_path / "p.svg"
    args = ["render", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", strategy]
    assert main([*args, "-o", str(out)]) == 0
    clusters, nodes, edges = svg_graph(out)
    assert sorted(clusters) == [f"cluster_rank{r}" for r in range(4)]
    plan = plan_for(small, strategy)
    for rank in range(4):
        assert node("L1.filter", rank) in nodes and node("L0.filter.grad", rank) in nodes
    checked = 0
    for tp in plan.tasks:
        for t in tp.transfers:
            if t.reduce:
                continue
            for dst in t.dsts:
                into = [
                    text
                    for (tail, head), texts in edges.items()
                    if head == node(tp.task, dst) and tail.endswith(f"@r{t.src}")
                    for text in texts
                ]
                assert f"{rect_text(t.rect)} {bytes_text(t.nbytes)}" in into, (tp.task, t)
                checked += 1
        for r in tp.reductions:
            bounds = r.targets[0][0]
            for rank in r.participants:
                texts = [
                    text
                    for (tail, head), texts in edges.items()
                    if tail == node(tp.task, rank) and head.startswith(f"piece/{r.algorithm}/")
                    for text in texts
                ]
                assert f"{rect_text(bounds)} {bytes_text(r.nbytes)}" in texts, (tp.task, r)
                checked += 1
    # data: only collectives cross ranks; spatial: halos (12 per 2x2 conv) and the batch regroup
    assert checked >= (4 * 9 if strategy == "data" else 24)


def test_every_transfer_is_a_link_between_the_right_ranks(small):
    plan = plan_for(small, "spatial")
    view = piece_view(small, plan)
    pieces = view.pieces
    planned = Counter()
    for tp in plan.tasks:
        for t in tp.transfers:
            for dst in t.dsts:
                planned[(t.reduce, t.tensor, t.rect, t.src, dst)] += t.nbytes
    drawn = Counter()
    for link in view.cross_links():
        if link.kind in ("transfer", "reduce"):
            src, dst = pieces[link.src].rank, pieces[link.dst].rank
            assert src != dst, link
            key = (link.kind == "reduce", link.tensor, link.rect, src, dst)
            drawn[key] += link.nbytes
    assert drawn == planned


def test_halo_partial_sums_go_to_the_piece_that_reads_them(small):
    view = piece_view(small, plan_for(small, "spatial"))
    sums = [
        link
        for link in view.links
        if link.kind == "reduce" and link.tensor == "L0.filterNL.output.grad"
    ]
    assert len(sums) == 12
    assert {view.pieces[link.src].name for link in sums} == {"L1.filter.grad"}
    assert {view.pieces[link.dst].name for link in sums} == {"L0.filterNL.grad"}


def test_a_sum_read_on_its_holder_links_every_part_it_is_made_of(small):
    # Under the spatial split rank 1 holds a quarter of L1's output gradient for the whole batch;
    # the classifier's gradient is split by batch, so rank 1's own contribution covers a quarter
    # of that cell, the other ranks' partial sums add to it, and the rest of the cell is still
    # the zeroed copy: the reader links to all of them, not only to the cell's last writer.
    tensor = "L1.filterNL.output.grad"
    view = piece_view(small, plan_for(small, "spatial"))
    reader = piece_id("L1.filterNL.grad", 1)
    into = {
        (link.src, link.kind) for link in view.links if link.dst == reader and link.tensor == tensor
    }
    assert into == {
        *((piece_id("classifier.linear1.grad", r), "reduce") for r in (0, 2, 3)),
        (piece_id("classifier.linear1.grad", 1), "local"),
        (piece_id(f"{tensor}.set_zero", 1), "local"),
    }


def test_a_replicated_update_sits_on_every_holder_behind_its_allreduce(small):
    view = piece_view(small, plan_for(small, "data"))
    (allreduce,) = [c for c in view.collectives.values() if c.tensors == ["L0.W.grad"]]
    assert allreduce.algorithm == "allreduce" and allreduce.participants == (0, 1, 2, 3)
    into = {link.src for link in view.links if link.dst == allreduce.id}
    out = {link.dst for link in view.links if link.src == allreduce.id}
    assert into == {piece_id("L0.filter.grad", r) for r in range(4)}
    assert out == {piece_id("update_L0.W", r) for r in range(4)}
    assert {n.rank for n in view.pieces.values() if n.name == "update_L0.W"} == {0, 1, 2, 3}
    # data parallelism moves no activations
    assert not [link for link in view.links if link.kind in ("transfer", "reduce")]


def test_an_allgather_runs_from_each_owners_writer_to_every_other_reader(small):
    """A model-parallel classifier reads all of L1's output, all-gathered (`partitioner.gathers`):
    each rank's filterNL piece feeds the gather, which feeds the classifier on every other rank
    with the parts it lacks."""
    view = piece_view(small, plan_for(small, "model"))
    (gather,) = [c for c in view.collectives.values() if c.tensors == ["L1.filterNL.output"]]
    assert gather.algorithm == "allgather" and gather.participants == (0, 1, 2, 3)
    into = {link.src for link in view.links if link.dst == gather.id}
    out = Counter(link.dst for link in view.links if link.src == gather.id)
    assert into == {piece_id("L1.filterNL", r) for r in range(4)}
    assert out == {piece_id("classifier.linear1", r): 3 for r in range(4)}


def test_forward_only_keeps_the_forward_messages(tmp_path, small):
    plan = plan_for(small, "spatial")
    names = {t.name for t in forward_only(small).tasks}
    view = piece_view(small, plan, names)
    assert {n.phase for n in view.pieces.values()} <= {"forward", "set_zero"}
    halos = sum(len(t.dsts) for t in task_plan(plan, "L1.filter").transfers)
    assert len([link for link in view.links if link.dst.startswith("L1.filter@")]) >= halos
    assert {c.algorithm for c in view.collectives.values()} == {"reduce"}
    out = tmp_path / "f.svg"
    args = ["render", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", "spatial"]
    assert main([*args, "--forward-only", "-o", str(out)]) == 0
    clusters, nodes, _ = svg_graph(out)
    assert len(clusters) == 4
    assert not [n for n in nodes if ".grad" in n or "update_" in n]


def test_the_layer_view_has_a_node_per_unit_and_rank_and_keeps_the_bytes(tmp_path, small):
    plan = plan_for(small, "spatial")
    full = piece_view(small, plan)
    collapsed = collapse_by_unit(full)
    units = {tp.unit for tp in plan.tasks}
    assert {(n.name, n.rank) for n in collapsed.pieces.values()} <= {
        (u, r) for u in units for r in range(4)
    }
    assert ("L1", 3) in {(n.name, n.rank) for n in collapsed.pieces.values()}
    for kind in ("transfer", "reduce", "collective"):
        before = sum(link.nbytes for link in full.links if link.kind == kind)
        after = sum(link.nbytes for link in collapsed.links if link.kind == kind)
        assert before == after, kind
    out = tmp_path / "l.svg"
    args = ["render", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", "spatial"]
    assert main([*args, "--collapse", "layer", "-o", str(out)]) == 0
    clusters, nodes, _ = svg_graph(out)
    assert len(clusters) == 4
    assert node("L1.forward", 2) in nodes and node("L1.backward", 2) in nodes
    assert node("L1.filter", 2) not in nodes


def test_max_nodes_collapses_the_partitioned_view(tmp_path, capsys):
    out = tmp_path / "m.dot"
    args = ["render", "seed-lcn-small", "--batch", "8", "--ranks", "4", "--strategy", "data"]
    assert main([*args, "--max-nodes", "40", "-o", str(out)]) == 0
    assert "more than --max-nodes 40" in capsys.readouterr().err
    assert "cluster_rank3" in out.read_text() and '"piece/L0.forward@r3"' in out.read_text()


def test_partition_graphviz_is_pure(small, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dot = partition_graphviz(small, plan_for(small, "model"), rankdir="LR")
    assert isinstance(dot, graphviz.Digraph)
    assert "rankdir=LR" in dot.source and "cluster_rank3" in dot.source
    assert list(tmp_path.iterdir()) == []


def test_a_strategy_file_and_auto_render(tmp_path):
    # from_grids asks every unit for exactly R pieces, and evaluate.accuracy's space is (1,):
    # on these networks a strategy file can only describe one rank (a partitioner limitation).
    grids = tmp_path / "grids.json"
    grids.write_text(
        '{"grids": {"L0": [1, 1, 1, 1], "L1": [1, 1, 1, 1], "classifier.linear1": [1, 1, 1, 1],'
        ' "classifier.softmax": [1, 1, 1, 1], "classifier.evaluate.accuracy": [1]}}'
    )
    out = tmp_path / "s.svg"
    args = ["render", "seed-lcn-small", "--batch", "8"]
    assert main([*args, "--ranks", "1", "--strategy", str(grids), "-o", str(out)]) == 0
    clusters, _, edges = svg_graph(out)
    assert clusters == ["cluster_rank0"] and all(t == [""] for t in edges.values())
    assert main([*args, "--ranks", "2", "-o", str(out)]) == 0  # auto
    assert sorted(svg_graph(out)[0]) == ["cluster_rank0", "cluster_rank1"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--strategy", "data"], "--strategy applies to a partitioned drawing; give --ranks R"),
        (["--ranks", "0"], "--ranks must be at least 1, got 0"),
        (["--ranks", "4", "--strategy", "diagonal"], "unknown strategy 'diagonal'"),
        (["--ranks", "4", "--strategy", "missing.json"], "missing.json"),
    ],
    ids=["strategy-without-ranks", "zero-ranks", "unknown-strategy", "missing-strategy-file"],
)
def test_bad_partition_flags_fail_with_one_line_and_no_file(tmp_path, capsys, extra, message):
    out = tmp_path / "x.svg"
    assert main(["render", "seed-lcn-small", *extra, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_imported_dump_renders_data_parallel(tmp_path, capsys):
    out = tmp_path / "dump.svg"
    dump = str(FIXTURES / "chainer_chain.txt")
    assert main(["render", dump, "--ranks", "2", "--strategy", "data", "-o", str(out)]) == 0
    clusters, _, edges = svg_graph(out)
    assert sorted(clusters) == ["cluster_rank0", "cluster_rank1"]
    assert any(head.startswith("piece/allreduce/") for _, head in edges)
    assert main(["render", dump, "--ranks", "2", "-o", str(out)]) == 0
    assert "can be cut over the batch only: planning data parallelism" in capsys.readouterr().err
    spatial = tmp_path / "spatial.svg"
    assert main(["render", dump, "--ranks", "2", "--strategy", "spatial", "-o", str(spatial)]) == 2
    err = capsys.readouterr().err
    assert "can be cut over the batch only" in err and len(err.strip().splitlines()) == 1
    assert not spatial.exists()


@pytest.mark.parametrize("command", ["render", "partition"])
def test_a_task_without_an_access_map_is_refused_cleanly(tmp_path, capsys, command):
    graph = tmp_path / "g.json"
    assert main(["graph", "seed-lcn-small", "--batch", "8", "--json", str(graph)]) == 0
    data = json.loads(graph.read_text())
    for task in data["tasks"]:
        if task["op"] == "filterNL":
            task["op"] = "mystery"
    graph.write_text(json.dumps(data))
    out = tmp_path / "x.svg"
    args = [command, str(graph), "--ranks", "2", "--strategy", "data"]
    assert main([*args, *(["-o", str(out)] if command == "render" else [])]) == 2
    err = capsys.readouterr().err
    assert "task L0.filterNL (op mystery, forward) has no access map" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
