"""A graph's pieces (`partitioner.pieces`): found once per task and grid for every plan of the graph,
and gone with the graph."""

from __future__ import annotations

import gc
import weakref

from legion_nn.networks import load_network
from partitioner.pieces import graph_pieces
from partitioner.plan import build_plan
from partitioner.strategy import builtin


def _graph():
    return load_network("seed-lcn-small").lower(batch=8)


def test_a_graphs_plans_share_its_pieces_and_another_graph_has_its_own():
    graph, other = _graph(), _graph()
    first = build_plan(graph, builtin(graph, "spatial", 4), 4)
    again = build_plan(graph, builtin(graph, "spatial", 4), 4)
    elsewhere = build_plan(other, builtin(other, "spatial", 4), 4)
    for a, b, c in zip(first.tasks, again.tasks, elsewhere.tasks, strict=True):
        for x, y, z in zip(a.piece_sets, b.piece_sets, c.piece_sets, strict=True):
            if a.grid is not None:  # a homed task's pieces follow its homes
                assert x is y and x is not z
    assert graph_pieces(graph) is not graph_pieces(other)
    assert graph_pieces(graph).graph is graph


def test_a_graphs_pieces_go_with_it():
    graph = _graph()
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    kept = weakref.ref(graph_pieces(graph))
    del graph, plan
    gc.collect()
    assert kept() is None
