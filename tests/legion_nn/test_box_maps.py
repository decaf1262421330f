"""The access maps over arrays (the records' `box_map`s) give the layers' own rects."""

from unittest import mock

import numpy as np
import pytest

from legion_nn.layers import (
    BatchNorm,
    ChannelAffine,
    Conv,
    Filter,
    Linear,
    MaxPool,
    Softmax,
)
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.op_records import access_map, box_map
from legion_nn.rect import Rect
from partitioner import boxes
from partitioner import pieces as pieces_module
from partitioner.pieces import grid_pieces


def _graphs():
    odd = Network(
        "odd",
        (3, 11, 9),
        5,
        [
            Filter("L0", out_channels=4, kernel=3, stride=2, pad=1, untied=False),
            MaxPool("P0", kernel=3, stride=2, pad=1),
            Conv("C1", out_channels=6, kernel=(2, 3), pad=(0, 1, 1, 0)),
            Filter("L2", out_channels=2, kernel=2, update_channels=[1, 3]),
            Linear("c", out=5, bias=True),
            Softmax(),
        ],
    )
    normed = Network(
        "normed",
        (3, 6, 5),
        4,
        [
            Conv("C0", out_channels=4, kernel=3, pad=1),
            BatchNorm("B0"),
            ChannelAffine("A0"),
            BatchNorm("B1", spatial=False),
            ChannelAffine("A1", shift=False),
            Linear("c", out=4, bias=True),
            Softmax(),
        ],
    )
    return [
        normed.lower(batch=6),
        load_network("seed-lcn-small").lower(batch=5),
        load_network("vgg19").lower(batch=3),
        odd.lower(batch=7),
    ]


@pytest.mark.parametrize("graph", _graphs(), ids=lambda g: g.network)
def test_box_maps_match_the_access_maps_on_random_pieces(graph):
    rng = np.random.default_rng(3)
    checked = 0
    for task in graph.tasks:
        boxed = box_map(task.op, task.phase)
        if boxed is None:
            continue
        dims = {r.role: graph.tensors[r.tensor].dims for r in task.requirements}
        space = task.space
        lo = np.stack([rng.integers(a, b, 40) for a, b in zip(space.lo, space.hi)], axis=1)
        hi = np.stack([rng.integers(x + 1, b + 1) for x, b in zip(lo.T, space.hi)], axis=1)
        found = boxed(task.attrs, dims, lo, hi)
        assert set(found) == set(dims)
        fn = access_map(task.op, task.phase)
        for i in range(len(lo)):
            expected = fn(task.attrs, dims, Rect(lo[i], hi[i]))
            for role, (role_lo, role_hi) in found.items():
                shape = (len(lo), len(dims[role]))
                a = np.broadcast_to(role_lo, shape)[i]
                b = np.broadcast_to(role_hi, shape)[i]
                got = Rect(a, b)
                if expected[role].is_empty():
                    assert got.is_empty(), (task.name, role)
                else:
                    assert got == expected[role], (task.name, role)
        checked += 1
    assert checked


@pytest.mark.parametrize("graph", [_graphs()[0], _graphs()[2]], ids=lambda g: g.network)
def test_grid_pieces_with_and_without_box_maps_agree(graph):
    for task in graph.tasks[:40]:
        if box_map(task.op, task.phase) is None:
            continue
        grid = tuple(min(4, e) for e in task.space.shape)
        with_boxes = grid_pieces(graph, task, grid)
        with mock.patch.object(pieces_module, "box_map", lambda op, phase: None):
            probed = grid_pieces(graph, task, grid)
        assert with_boxes.pieces() == probed.pieces()


def test_a_box_map_that_disagrees_is_not_used():
    graph = load_network("seed-lcn-small").lower(batch=2)
    task = graph.task("L0.filter")
    real = box_map(task.op, task.phase)

    def shifted(attrs, dims, lo, hi):
        found = dict(real(attrs, dims, lo, hi))
        halo_lo, halo_hi = found["input"]
        found["input"] = (halo_lo, halo_hi + 1)
        return found

    with mock.patch.object(pieces_module, "box_map", lambda op, phase: shifted):
        got = grid_pieces(graph, task, (1, 1, 4, 4, 1))
    with mock.patch.object(pieces_module, "box_map", lambda op, phase: None):
        expected = grid_pieces(graph, task, (1, 1, 4, 4, 1))
    assert got.pieces() == expected.pieces()
    assert not np.array_equal(
        got.req_hi[0], shifted(task.attrs, _dims(graph, task), got.lo, got.hi)["input"][1]
    )


def _dims(graph, task):
    return {r.role: graph.tensors[r.tensor].dims for r in task.requirements}


def test_empty_rects_come_back_as_zeros():
    lo, hi = np.array([[0, 2], [1, 1]], boxes.INDEX), np.array([[3, 2], [2, 4]], boxes.INDEX)
    zeroed = pieces_module._zero_empty(lo.copy(), hi.copy())
    assert zeroed[0].tolist() == [[0, 0], [1, 1]]
    assert zeroed[1].tolist() == [[0, 0], [2, 4]]
