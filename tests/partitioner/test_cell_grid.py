"""The cell grid's counts and summed volumes against a dense count of every element."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.rect import Rect
from partitioner.cell_grid import CellGrid, join

EXTENT = 7


def boxes_in(ndim: int, count: int):
    bound = st.tuples(st.integers(0, EXTENT), st.integers(0, EXTENT))
    box = st.tuples(*[bound] * ndim).map(
        lambda b: Rect(tuple(min(x) for x in b), tuple(max(x) for x in b))
    )
    return st.lists(st.tuples(st.integers(0, 2), box), min_size=1, max_size=count)


def dense(rect: Rect) -> np.ndarray:
    out = np.zeros((EXTENT,) * rect.ndim, np.int64)
    out[tuple(slice(a, b) for a, b in zip(rect.lo, rect.hi))] = 1
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(boxes_in(n, 12), boxes_in(n, 6))))
def test_counts_and_volumes_per_layer_match_a_dense_count(groups):
    covering, asked = groups
    rects = [r for _, r in covering] + [r for _, r in asked]
    layer = np.array([k for k, _ in covering] + [k for k, _ in asked])
    ndim = rects[0].ndim
    lo = np.array([r.lo for r in rects]).reshape(-1, ndim)
    hi = np.array([r.hi for r in rects]).reshape(-1, ndim)
    grid = CellGrid(lo, hi, [len(covering), len(asked)], layer, 3)
    count = grid.count(0)
    once = grid.volume_where(count == 1, 1)
    for k in range(3):
        elements = sum((dense(r) for j, r in covering if j == k), np.zeros((EXTENT,) * ndim, int))
        # every element's count, read back through the cell that holds it
        assert int(count[k].max(initial=0)) == int(elements.max())
        for index, (j, rect) in enumerate(asked):
            if j == k:
                assert once[index] == int(((elements == 1) & (dense(rect) == 1)).sum())
    for k, alone in enumerate(grid.by_layer()):
        assert alone.rows[0].tolist() == [i for i, (j, _) in enumerate(covering) if j == k]
        assert alone.rows[1].tolist() == [i for i, (j, _) in enumerate(asked) if j == k]
        assert (alone.count(0)[0].max(initial=0) if len(alone.rows[0]) else 0) == int(
            count[k].max(initial=0)
        )


def test_join_pairs_every_equal_key():
    left, right = np.array([3, 1, 3, 7]), np.array([3, 3, 1, 5])
    i, j = join(left, right)
    assert sorted(zip(i.tolist(), j.tolist())) == [(0, 0), (0, 1), (1, 2), (2, 0), (2, 1)]
