"""`grid_loads` and `grid_combine`: per-rank link loads, held bytes and collectives computed dim
by dim equal what `messages.fetch` / `messages.combine` list message by message, on random
layouts and reads."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from partitioner import boxes
from partitioner.accounting import received_once, staged_bytes
from partitioner.collective_prices import collective_costs, reduction_cost
from partitioner.grid_combine import combine_loads
from partitioner.grid_loads import fetch_loads
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.messages import Accesses, combine, fetch
from partitioner.plan import reductions_of
from partitioner.transfers import link_loads

#: a latency-bound machine (trees and halving win) and a bandwidth-bound one (rings win)
MACHINE = Machine(link_gbytes_per_s=1.0, latency_us=50.0)
SLOW_LINK = Machine(link_gbytes_per_s=0.01, latency_us=0.1)


class Refused(Exception):
    pass


def refuse(message: str) -> Exception:
    return Refused(message)


@st.composite
def cases(draw):
    """A layout of a small tensor over a few ranks, and the rects a grid of pieces touches."""
    ndim = draw(st.integers(1, 3))
    dims = [draw(st.integers(1, 9)) for _ in range(ndim)]
    nranks = draw(st.integers(1, 9))
    cuts = []
    for extent in dims:
        inner = draw(st.sets(st.integers(1, max(extent - 1, 1)), max_size=3))
        cuts.append(sorted({0, extent} | {c for c in inner if 0 < c < extent}))
    ncells = int(np.prod([len(c) - 1 for c in cuts]))
    mode = draw(st.sampled_from(["clean", "clean", "clean", "gaps", "shared"]))
    holders = {}
    for cell in range(ncells):
        kind = "one"
        if mode != "clean":
            kind = draw(st.sampled_from(["one", "one", "one", "none" if mode == "gaps" else "two"]))
        if kind == "one":
            holders[cell] = (draw(st.integers(0, nranks - 1)),)
        elif kind == "two" and nranks > 1:
            holders[cell] = tuple(
                sorted(draw(st.sets(st.integers(0, nranks - 1), min_size=2, max_size=2)))
            )
    layout = Layout(cuts, holders)
    # pieces: a grid, each dim either followed by its own piece dim (with a halo) or read whole
    grid = [draw(st.integers(1, min(extent, 3))) for extent in dims]
    follow = [draw(st.booleans()) for _ in dims]
    halo = [draw(st.integers(0, 2)) for _ in dims]
    overhang = draw(st.booleans())  # rects may stick out of the tensor
    per_dim = []
    for extent, parts, f, h in zip(dims, grid, follow, halo):
        bounds = np.linspace(0, extent, parts + 1).astype(int)
        spans = []
        for a, b in pairwise(bounds):
            lo, hi = (a - h, b + h) if f else (0, extent)
            if not overhang:
                lo, hi = max(lo, 0), min(hi, extent)
            spans.append((lo, hi))
        per_dim.append(spans)
    pieces = list(np.ndindex(*grid))
    order = draw(st.permutations(range(max(len(pieces), nranks))))
    ranks = np.array([order[i] % nranks for i in range(len(pieces))], boxes.INDEX)
    lo = np.array([[per_dim[e][p[e]][0] for e in range(ndim)] for p in pieces], boxes.INDEX)
    hi = np.array([[per_dim[e][p[e]][1] for e in range(ndim)] for p in pieces], boxes.INDEX)
    keep = boxes.nonempty(lo, hi)
    accesses = Accesses(
        ranks[keep], lo[keep], hi[keep], np.arange(int(keep.sum()), dtype=boxes.INDEX)
    )
    fresh = None
    if draw(st.booleans()):
        fresh = np.array([draw(st.booleans()) for _ in range(len(accesses.ranks))], bool)
    itemsize = draw(st.sampled_from([4, 8]))
    return layout, accesses, fresh, itemsize, nranks, mode == "clean"


def unique_pairs(accesses: Accesses) -> bool:
    rect = np.repeat(np.arange(len(accesses)), np.diff(accesses.ptr))
    pairs = set(zip(rect.tolist(), accesses.ranks.tolist()))
    return len(pairs) == len(accesses.ranks)


def one_rect_each(accesses: Accesses, fresh: np.ndarray | None) -> bool:
    ranks = accesses.ranks if fresh is None else accesses.ranks[fresh]
    return len(set(ranks.tolist())) == len(ranks)


def as_ints(loads):
    return tuple(np.asarray(x).astype(np.int64).tolist() for x in loads)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_fetch_loads_are_those_of_the_messages(case):
    layout, accesses, fresh, itemsize, nranks, clean = case
    every = np.ones(len(accesses.ranks), bool) if fresh is None else fresh
    fast = fetch_loads(layout, accesses, fresh, itemsize, nranks)
    try:
        block = fetch("t", itemsize, layout, accesses, every, refuse)
    except Refused:
        assert fast is None
        return
    if fast is None:
        assert not (clean and one_rect_each(accesses, fresh))
        event("fetch: outside the fast path")
        return  # outside the fast path's preconditions
    event(f"fetch: compared, moves {'something' if len(block) else 'nothing'}")
    assert as_ints((fast.sent, fast.received, fast.rounds)) == as_ints(link_loads([block], nranks))
    assert fast.wire == int(np.dot(block.nbytes, block.fanout))
    held = received_once([block], nranks)[0] if len(block) else np.zeros(nranks)
    assert fast.held.tolist() == held.astype(np.int64).tolist()
    assert fast.staged.tolist() == staged_bytes(block, nranks).tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_combine_loads_are_those_of_the_partial_sums_and_collectives(case):
    layout, accesses, _, itemsize, nranks, clean = case
    fast = combine_loads(layout, accesses, itemsize, nranks)
    try:
        block, found = combine("t", itemsize, layout, accesses, 0, refuse)
    except Refused:
        assert fast is None
        return
    if fast is None:
        assert not (clean and unique_pairs(accesses))
        event("combine: outside the fast path")
        return
    moved, collectives = fast
    event(f"combine: compared, partial sums: {len(block) > 0}, collectives: {len(found) > 0}")
    assert as_ints((moved.sent, moved.received, moved.rounds)) == as_ints(
        link_loads([block], nranks)
    )
    sent = np.bincount(block.src, weights=block.nbytes, minlength=nranks).astype(np.int64)
    assert moved.held.tolist() == sent.tolist()
    assert moved.staged.tolist() == staged_bytes(block, nranks).tolist()
    assert moved.wire == int(np.dot(block.nbytes, block.fanout))
    reductions = reductions_of("t", itemsize, found)
    assert len(collectives) == len(reductions)
    for k, reduction in enumerate(reductions):
        mine = collectives.which == k
        assert tuple(collectives.participants(k).tolist()) == reduction.participants
        assert ("reduce" if collectives.reduce[k] else "reduce_scatter") == reduction.algorithm
        targets = [
            (tuple(lo), tuple(hi), (h,))
            for lo, hi, h in zip(
                collectives.lo[mine].tolist(),
                collectives.hi[mine].tolist(),
                collectives.holders[mine].tolist(),
            )
        ]
        assert targets == [(r.lo, r.hi, h) for r, h in reduction.targets]
        assert collectives.total[k] == reduction.nbytes
        extras = len(reduction.participants) - len(reduction.summed_from)
        event(f"combine: a {reduction.algorithm} with{'' if extras else 'out'} extras")
    # priced float for float as the plan's collectives are (`reduction_cost`)
    for machine in (MACHINE, SLOW_LINK):
        seconds, wire = collective_costs(
            collectives.reduce,
            collectives.contributors,
            collectives.total,
            collectives.largest,
            machine,
            collectives.handed_most,
            collectives.handed_total,
        )
        priced = [reduction_cost(r, machine) for r in reductions]
        assert seconds.tolist() == [s for s, _ in priced]
        assert wire.tolist() == [w for _, w in priced]
