import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.rect import Rect, split_sizes
from partitioner import boxes as box_arrays


def test_repr_is_the_seed_form():
    assert repr(Rect.from_dims((256, 1, 41, 41))) == (
        "Rect(array([0, 0, 0, 0], dtype=int32), array([256, 1, 41, 41], dtype=int32))"
    )
    assert repr(Rect((0,), (1,))) == "Rect(array([0], dtype=int32), array([1], dtype=int32))"
    assert repr(Rect((2, -1), (3, 4))) == (
        "Rect(array([2, -1], dtype=int32), array([3, 4], dtype=int32))"
    )


def test_immutable_and_hashable():
    rect = Rect((0, 1), (2, 3))
    with pytest.raises(AttributeError):
        rect.lo = (1, 1)
    assert {rect: 1}[Rect((0, 1), (2, 3))] == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), min_size=1, max_size=4))
def test_emptiness_found_as_made_is_that_of_the_dims_however_made(bounds):
    """A rect is empty where some dim has hi <= lo, whether made by `Rect`, `Rect.made`, from arrays
    (`boxes.to_rects`, which finds emptiness for all rows at once), from one row
    (`boxes.to_rect`) or by `dataclasses.replace`; emptiness takes no part in equality."""
    lo, hi = tuple(b[0] for b in bounds), tuple(b[1] for b in bounds)
    empty = any(h <= low for low, h in bounds)
    made = [
        Rect(lo, hi),
        Rect.made(lo, hi),
        box_arrays.to_rect(lo, hi),
        box_arrays.to_rects(np.array([lo]), np.array([hi]))[0],
        dataclasses.replace(Rect(lo, tuple(v + 5 for v in lo)), hi=hi),
    ]
    assert [r.is_empty() for r in made] == [empty] * 5
    assert all(r == made[0] and hash(r) == hash(made[0]) for r in made)
    assert (made[0].volume == 0) == empty


def test_uneven_split_sizes():
    assert split_sizes(27, 4) == [7, 7, 7, 6]
    assert [r.shape[0] for r in Rect((0,), (27,)).split([4])] == [7, 7, 7, 6]
    assert split_sizes(7, 3) == [3, 2, 2]


def test_empty_rect_has_zero_volume_and_intersections():
    a, b = Rect((0, 0), (2, 2)), Rect((2, 0), (4, 2))
    assert a.intersect(b).is_empty() and a.intersect(b).volume == 0
    assert Rect.empty(3).volume == 0


def test_difference_of_a_hole():
    outer, hole = Rect((0, 0), (4, 4)), Rect((1, 1), (3, 3))
    parts = outer.difference(hole)
    assert sum(p.volume for p in parts) == 12
    assert all(not p.overlaps(hole) for p in parts)


def test_to_slices_selects_the_box():
    a = np.arange(5 * 6).reshape(5, 6)
    r = Rect((1, 2), (4, 5))
    assert a[r.to_slices()].shape == (3, 3)
    assert a[r.to_slices()][0, 0] == a[1, 2]


def test_translate_and_contains():
    r = Rect((0, 0), (2, 3)).translate((5, 1))
    assert r == Rect((5, 1), (7, 4))
    assert Rect((0, 0), (10, 10)).contains(r)
    assert not r.contains(Rect((0, 0), (10, 10)))


def test_rank_mismatch_is_an_error():
    with pytest.raises(ValueError, match="rank mismatch"):
        Rect((0,), (1,)).intersect(Rect((0, 0), (1, 1)))


@st.composite
def boxes(draw, ndim=None):
    n = ndim or draw(st.integers(1, 4))
    lo = [draw(st.integers(-5, 5)) for _ in range(n)]
    ext = [draw(st.integers(0, 6)) for _ in range(n)]
    return Rect(tuple(lo), tuple(a + e for a, e in zip(lo, ext)))


def points(rect):
    if rect.is_empty():
        return set()
    grids = np.meshgrid(*[np.arange(a, b) for a, b in zip(rect.lo, rect.hi)], indexing="ij")
    return set(zip(*[g.ravel().tolist() for g in grids]))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_split_pieces_are_disjoint_and_cover(data):
    box = data.draw(boxes())
    grid = [data.draw(st.integers(1, 5)) for _ in range(box.ndim)]
    pieces = box.split(grid)
    assert len(pieces) == int(np.prod(grid))
    assert sum(p.volume for p in pieces) == box.volume
    covered = set()
    for p in pieces:
        pts = points(p)
        assert not (covered & pts)
        covered |= pts
        assert box.contains(p)
    assert covered == points(box)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_intersection_and_difference_partition_a_box(data):
    a = data.draw(boxes())
    b = data.draw(boxes(ndim=a.ndim))
    inter = a.intersect(b)
    diff = a.difference(b)
    parts = [inter] + diff
    union = set()
    for p in parts:
        pts = points(p)
        assert not (union & pts)
        union |= pts
    assert union == points(a)
    assert points(inter) == points(a) & points(b)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_union_bounds_contains_both(data):
    a = data.draw(boxes())
    b = data.draw(boxes(ndim=a.ndim))
    u = a.union_bounds(b)
    assert u.contains(a) and u.contains(b)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_minus_many_leaves_disjoint_boxes_of_exactly_the_points_left(data):
    a = data.draw(boxes(ndim=data.draw(st.integers(1, 3))))
    cuts = data.draw(st.lists(boxes(ndim=a.ndim), max_size=4))
    left = a.minus(cuts)
    seen: set = set()
    for box in left:
        assert not box.is_empty() and not (seen & points(box))
        seen |= points(box)
    expected = points(a).difference(*[points(c) for c in cuts])
    assert seen == expected
    assert a.covered_by(cuts) == (not expected)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_bounding_is_the_union_of_bounds_and_overlap_volume_the_intersections(data):
    a = data.draw(boxes())
    others = data.draw(st.lists(boxes(ndim=a.ndim), max_size=5))
    expected = None
    for rect in [a, *others]:
        if not rect.is_empty():
            expected = rect if expected is None else expected.union_bounds(rect)
    assert Rect.bounding([a, *others]) == expected
    for other in others:
        assert a.overlap_volume(other) == len(points(a) & points(other))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_coverage_by_disjoint_parts_is_coverage(data):
    a = data.draw(boxes(ndim=data.draw(st.integers(1, 3))))
    around = data.draw(boxes(ndim=a.ndim))
    grid = [data.draw(st.integers(1, 3)) for _ in range(a.ndim)]
    cells = around.split(grid)
    kept = [c for c in cells if data.draw(st.booleans())]
    assert (
        a.covered_by_disjoint(kept)
        == a.covered_by(kept)
        == (points(a) <= set().union(*[points(c) for c in kept]))
    )
