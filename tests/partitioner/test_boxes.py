"""`partitioner.boxes.first_seen_ids` numbers equal rows alike, in order of first appearance;
`run_starts`, `run_ends` and `places_in_runs` find the runs of a grouped array as a walk does."""

import numpy as np
import pytest

from partitioner import boxes


def _reference(rows):
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    renumber = np.empty(len(first), np.int64)
    renumber[order] = np.arange(len(first))
    return renumber[inverse.reshape(-1)], first[order]


@pytest.mark.parametrize("scale", [1, 3, 1000, 2**40, 2**62])
def test_first_seen_ids_match_a_sort_of_the_rows(scale):
    rng = np.random.default_rng(scale % 97)
    for _ in range(60):
        # both ways: a dict of the rows' bytes up to FIRST_SEEN_BY_DICT_AT_MOST rows, a sort beyond
        n, k = int(rng.integers(1, 3 * boxes.FIRST_SEEN_BY_DICT_AT_MOST)), int(rng.integers(1, 12))
        rows = rng.integers(0, scale, (n, k), dtype=np.int64) if scale > 1 else np.zeros((n, k))
        rows = rows.astype(np.int64)[rng.integers(0, n, n)]  # with repeats
        ids, first = boxes.first_seen_ids(rows)
        expected_ids, expected_first = _reference(rows)
        assert np.array_equal(ids, expected_ids)
        assert np.array_equal(first, expected_first)


def _runs_walked(values):
    """(start, end) of each run of equal neighbours, and each element's place in its run."""
    runs, places = [], []
    for i, value in enumerate(values):
        if i == 0 or value != values[i - 1]:
            runs.append([i, i])
        runs[-1][1] = i + 1
        places.append(i - runs[-1][0])
    return runs, places


@pytest.mark.parametrize("seed", range(5))
def test_runs_are_found_as_a_walk_finds_them(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        values = np.sort(rng.integers(0, int(rng.integers(1, 8)), n))
        starts = boxes.run_starts(values[1:] != values[:-1])
        ends = boxes.run_ends(starts, n)
        runs, places = _runs_walked(values.tolist())
        assert [[a, b] for a, b in zip(starts.tolist(), ends.tolist())] == runs
        assert boxes.places_in_runs(starts, n).tolist() == places


@pytest.mark.parametrize(
    "n", [0, 1, 7, boxes.ROW_REDUCTION_AT_MOST, boxes.ROW_REDUCTION_AT_MOST + 1, 2000]
)
def test_volumes_and_emptiness_agree_with_the_rows_extents(n):
    rng = np.random.default_rng(n)
    for ndim in (0, 1, 4, 8):
        lo = rng.integers(-5, 5, (n, ndim))
        hi = lo + rng.integers(-2, 4, (n, ndim))
        extents = np.maximum(hi - lo, 0)
        assert boxes.volumes(lo, hi).tolist() == [int(np.prod(row)) for row in extents]
        assert boxes.nonempty(lo, hi).tolist() == [bool((row > 0).all()) for row in hi - lo]


@pytest.mark.parametrize("seed", range(4))
def test_bounding_by_key_is_each_keys_bounding_rect(seed):
    """Per key, the box `Rect.bounding` gives its rects (empty ones left out), for keys with a
    non-empty rect, ascending; none for a key whose rects are all empty."""
    from legion_nn.rect import Rect

    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, ndim = int(rng.integers(0, 300)), int(rng.integers(1, 5))
        keys = rng.integers(0, 9, n)
        lo = rng.integers(-6, 6, (n, ndim))
        hi = lo + rng.integers(-1, 5, (n, ndim))  # some empty
        found, box_lo, box_hi = boxes.bounding_by_key(keys, lo, hi)
        expected = {}
        for key in sorted(set(keys.tolist())):
            rects = [Rect(tuple(a), tuple(b)) for a, b, k in zip(lo.tolist(), hi.tolist(), keys)
                     if k == key]  # fmt: skip
            box = Rect.bounding(rects)
            if box is not None:
                expected[key] = (box.lo, box.hi)
        got = {
            k: (tuple(a), tuple(b))
            for k, a, b in zip(found.tolist(), box_lo.tolist(), box_hi.tolist())
        }
        assert got == expected
        assert found.tolist() == sorted(expected)
