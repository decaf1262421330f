"""The collectives' schedules (`partitioner.collectives`): run on vectors, each leaves the sums
where the reduction says, and the arrays they are held as read back as the rounds they stand for."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.rect import Rect, split_sizes
from partitioner.collectives import Hop, Schedule, schedule, target_order
from partitioner.machine import Machine
from partitioner.task_plan import Reduction


def _run(rounds, vectors: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The rounds carried out as the runtime does: every hop of a round reads what its sender
    held when the round began."""
    held = {rank: v.copy() for rank, v in vectors.items()}
    for hops in rounds:
        before = {rank: v.copy() for rank, v in held.items()}
        for hop in hops:
            part = before[hop.src][hop.lo : hop.hi]
            if hop.add:
                held[hop.dst][hop.lo : hop.hi] += part
            else:
                held[hop.dst][hop.lo : hop.hi] = part
    return held


@st.composite
def reductions(draw):
    algorithm = draw(st.sampled_from(["allreduce", "reduce_scatter", "reduce"]))
    p = draw(st.integers(2, 9))
    participants = tuple(draw(st.permutations(range(12)))[:p])
    if algorithm == "reduce_scatter":
        sizes = draw(st.lists(st.integers(0, 4), min_size=p, max_size=p))
        targets, lo = [], 0
        for rank, size in zip(participants, sizes):
            if size:
                targets.append((Rect((lo,), (lo + size,)), (rank,)))
                lo += size
        if not targets:
            targets = [(Rect((0,), (1,)), (participants[0],))]
    else:
        n = draw(st.integers(1, 30))
        holders = (
            participants if algorithm == "allreduce" else (draw(st.sampled_from(participants)),)
        )
        targets = [(Rect((0,), (n,)), holders)]
    return Reduction("g", algorithm, participants, tuple(targets), 8)


@settings(max_examples=300, deadline=None)
@given(reductions(), st.sampled_from([Machine(), Machine(latency_us=0.0)]))
def test_a_schedule_leaves_every_sum_where_its_targets_say(reduction, machine):
    rng = np.random.default_rng(0)
    order = target_order(reduction)
    n = sum(reduction.targets[t][0].volume for t in order)
    vectors = {rank: rng.integers(-9, 9, n).astype(float) for rank in reduction.participants}
    total = sum(vectors.values())
    held = _run(schedule(reduction, machine), vectors)
    offset = 0
    for t in order:
        rect, holders = reduction.targets[t]
        for rank in holders:
            got = held[rank][offset : offset + rect.volume]
            np.testing.assert_array_equal(got, total[offset : offset + rect.volume])
        offset += rect.volume


def _ring_reference(ranks, sizes, shift, add):
    """A ring's steps hop by hop, as the schedule describes them."""
    ends = np.cumsum(sizes)
    chunks = list(zip((ends - sizes).tolist(), ends.tolist()))
    p = len(ranks)
    return [
        [
            Hop(ranks[i], ranks[(i + 1) % p], *chunks[(i - step - shift) % p], add)
            for i in range(p)
            if chunks[(i - step - shift) % p][1] > chunks[(i - step - shift) % p][0]
        ]
        for step in range(p - 1)
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 10), st.data())
def test_the_arrays_read_back_as_the_rounds_and_their_totals(p, data):
    ranks = tuple(data.draw(st.permutations(range(16)))[:p])
    sizes = np.asarray(
        data.draw(st.one_of(
            st.just(split_sizes(data.draw(st.integers(1, 40)), p)),
            st.lists(st.integers(0, 3), min_size=p, max_size=p),
        )),
        np.int64,
    )  # fmt: skip
    expected = _ring_reference(ranks, sizes, 1, True) + _ring_reference(ranks, sizes, 0, False)
    reduction = Reduction(
        "g", "allreduce", ranks, ((Rect((0,), (max(int(sizes.sum()), 1),)), ranks),), 4
    )
    if split_sizes(int(sizes.sum()), p) == sizes.tolist() and sizes.sum():
        assert list(schedule(reduction, Machine())) == expected
    built = Schedule.of_rounds(expected)
    assert list(built) == expected and len(built) == len(expected)
    assert (
        list(Schedule.concat(Schedule.of_rounds(expected[:3]), Schedule.of_rounds(expected[3:])))
        == expected
    )
    sent: dict[int, int] = {}
    adding: dict[int, list[int]] = {}
    for hops in expected:
        k: dict[int, int] = {}
        for hop in hops:
            sent[hop.src] = sent.get(hop.src, 0) + (hop.hi - hop.lo) * 4
            if hop.add:
                sizes_of = adding.setdefault(hop.dst, [])
                slot = k.get(hop.dst, 0)
                if slot == len(sizes_of):
                    sizes_of.append(0)
                sizes_of[slot] = max(sizes_of[slot], hop.hi - hop.lo)
                k[hop.dst] = slot + 1
    assert built.sent(4) == sent
    assert built.adding_sizes == adding
    assert built.hops == sum(len(hops) for hops in expected)
