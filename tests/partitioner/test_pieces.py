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


def test_the_pieces_some_ranks_compute_are_those_of_every_piece_they_share():
    """A share of a plan's ranks has its pieces made alone (`PieceSet.pieces_of`): the pieces,
    in order, equal to every piece made at once, with a homed piece that several ranks compute
    made for any of them."""
    import numpy as np

    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    for family in ("data", "spatial", "model"):
        plan = build_plan(graph, builtin(graph, family, 4), 4)
        for task_plan in plan.tasks:
            for piece_set in task_plan.piece_sets:
                every = piece_set.pieces()
                for share in ([0, 1], [3], [1, 2, 3]):
                    expected = [p for p in every if set(p.ranks) & set(share)]
                    assert piece_set.pieces_of(np.array(share)) == expected
                which = np.arange(len(every))[::2]
                assert piece_set.pieces(which) == every[::2]
