"""The step buffers' placement (`runtime.step.buffers`): live buffers never share bytes."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.step import buffers
from runtime.step.buffers import (
    _COLOUR_STEP,
    COLOURED,
    LINE,
    PAGE,
    Arena,
    Slot,
    _placement,
    _reserved,
    contiguous,
    place,
)
from runtime.step.compiled_placement import first_fit


@st.composite
def slot_sets(draw):
    length = draw(st.integers(1, 12))
    count = draw(st.integers(1, 25))
    slots = []
    for k in range(count):
        first = draw(st.integers(0, length - 1))
        last = draw(st.integers(first, length - 1))
        nbytes = draw(st.one_of(st.integers(1, 5000), st.integers(60_000, 300_000)))
        slots.append(Slot(("s", k), nbytes, first, last, "activations"))
    return slots, length


#: a page-aligned buffer that the gap before its alignment fitted but the aligned one did not
_ALIGNED_PAST_ITS_GAP = (
    [
        Slot(("s", k), nbytes, first, last, "activations")
        for k, (nbytes, first, last) in enumerate(
            [(108417, 0, 0), (108417, 0, 1), (1, 0, 0), (1, 0, 0), (172033, 2, 2), (1, 0, 0),
             (184321, 2, 2), (1, 0, 0), (1, 0, 0), (108418, 0, 2), (253953, 1, 1), (108418, 0, 0)]
        )
    ],
    3,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(slot_sets())
@example(_ALIGNED_PAST_ITS_GAP)
def test_buffers_live_at_once_never_overlap(case):
    slots, length = case
    placed = place(slots, length)
    for a in slots:
        start = placed.offsets[a.key]
        assert start + a.nbytes <= placed.size
        for b in slots:
            if a.key == b.key or a.last < b.first or b.last < a.first:
                continue
            other = placed.offsets[b.key]
            assert start + a.nbytes <= other or other + b.nbytes <= start, (a, b)
    live = [sum(s.nbytes for s in slots if s.first <= t <= s.last) for t in range(length)]
    assert list(placed.live()) == live
    assert placed.peak == max(live) <= placed.size


def _first_fit(order):
    """First fit by a scan: each slot past the placed slots live with it, in order of offset,
    at the first gap that holds it (a coloured slot's offset rounded up to a page first)."""
    placed, starts, size, colour = [], [], 0, 0
    for nbytes, first, last in order:
        need = _reserved(nbytes)
        busy = sorted((o, e) for o, e, f, la in placed if f <= last and first <= la)
        coloured = nbytes >= COLOURED
        offset = 0
        for lo, hi in busy:
            if coloured:
                offset = -(-offset // PAGE) * PAGE
            if offset + need <= lo:
                break
            offset = max(offset, hi)
        if coloured:
            offset = -(-offset // PAGE) * PAGE
            starts.append(offset + colour * _COLOUR_STEP * LINE % PAGE)
            colour += 1
        else:
            starts.append(offset)
        placed.append((offset, offset + need, first, last))
        size = max(size, offset + need)
    return starts, size


@settings(max_examples=300, deadline=None)
@given(slot_sets())
@example(_ALIGNED_PAST_ITS_GAP)
def test_placement_is_first_fit(case):
    slots, _ = case
    order = tuple(
        (s.nbytes, s.first, s.last) for s in sorted(slots, key=lambda s: (-s.nbytes, s.first))
    )
    assert _placement.__wrapped__(order) == _first_fit(order)


@settings(max_examples=300, deadline=None)
@given(slot_sets())
@example(_ALIGNED_PAST_ITS_GAP)
def test_the_compiled_placement_is_first_fit(case):
    slots, _ = case
    order = tuple(
        (s.nbytes, s.first, s.last) for s in sorted(slots, key=lambda s: (-s.nbytes, s.first))
    )
    table = np.asarray(order, np.int64).reshape(-1, 3)
    starts, size = first_fit(table, LINE, PAGE, COLOURED, _COLOUR_STEP)
    assert (starts.tolist(), int(size)) == _first_fit(order)


def test_many_slots_are_placed_by_the_compiled_scan_as_by_numpy(monkeypatch):
    rng = np.random.default_rng(3)
    count = buffers.COMPILED_FROM + 500
    first = rng.integers(0, 400, count)
    last = first + rng.integers(0, 60, count)
    nbytes = np.where(rng.random(count) < 0.2, rng.integers(65_536, 2**22, count),
                      rng.integers(1, 65_536, count))  # fmt: skip
    order = tuple(sorted(zip(nbytes.tolist(), first.tolist(), last.tolist()),
                         key=lambda s: (-s[0], s[1])))  # fmt: skip
    compiled = _placement.__wrapped__(order)
    monkeypatch.setattr(buffers, "COMPILED_FROM", count + 1)
    assert _placement.__wrapped__(order) == compiled


def test_an_arena_view_writes_only_its_slot():
    slots = [Slot("a", 800, 0, 1, "activations"), Slot("b", 80_000, 1, 2, "gradients")]
    placed = place(slots, 3)
    arena = Arena()
    arena.reserve(placed.size)
    a = arena.view(placed, "a", (100,), np.float64)
    b = arena.view(placed, "b", (100, 100), np.float64)
    a[...] = 1.0
    b[...] = 2.0
    assert (a == 1.0).all() and (b == 2.0).all()
    assert b.ctypes.data % 64 == 0 and a.ctypes.data % 64 == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=4))
def test_contiguity_matches_numpy(axes):
    whole = tuple(n for n, _ in axes)
    block = tuple(max(1, min(n, n - cut)) for n, cut in axes)
    view = np.empty(whole)[tuple(slice(0, b) for b in block)]
    assert contiguous(block, whole) == view.flags.c_contiguous
