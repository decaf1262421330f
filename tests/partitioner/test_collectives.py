"""The collectives' schedules (`partitioner.collectives`): run on vectors, each leaves the sums
where the reduction says, and the arrays they are held as read back as the rounds they stand for."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.rect import Rect, split_sizes
from partitioner.collective_prices import (
    allreduce_algorithm,
    collective_cost,
    reduce_by_tree,
    reduction_cost,
)
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
    """A collective over up to 9 ranks; a reduce-scatter's owners may include up to 4 extra
    participants, which own targets but add nothing (`Reduction.contributors`)."""
    algorithm = draw(st.sampled_from(["allreduce", "reduce_scatter", "reduce"]))
    p = draw(st.integers(2, 9))
    ranks = draw(st.permutations(range(16)))
    participants = tuple(ranks[:p])
    if algorithm == "reduce_scatter":
        extras = ranks[p : p + draw(st.integers(0, 4))]
        owners = participants + tuple(extras)
        sizes = draw(st.lists(st.integers(0, 4), min_size=len(owners), max_size=len(owners)))
        targets, lo = [], 0
        for rank, size in zip(owners, sizes):
            if size:
                targets.append((Rect((lo,), (lo + size,)), (rank,)))
                lo += size
        if not targets:
            targets = [(Rect((0,), (1,)), (participants[0],))]
        owning = {holders[0] for _, holders in targets} - set(participants)
        if owning:  # the extras that own a target
            everyone = tuple(sorted(owning.union(participants)))
            contributors = tuple(sorted(participants))
            return Reduction("g", algorithm, everyone, tuple(targets), 8, (), contributors)
    else:
        n = draw(st.integers(1, 30))
        holders = (
            participants if algorithm == "allreduce" else (draw(st.sampled_from(participants)),)
        )
        targets = [(Rect((0,), (n,)), holders)]
    return Reduction("g", algorithm, participants, tuple(targets), 8)


@settings(max_examples=300, deadline=None)
@given(
    reductions(), st.sampled_from([Machine(), Machine(latency_us=0.0), Machine(latency_us=50.0)])
)
def test_a_schedule_leaves_every_sum_where_its_targets_say(reduction, machine):
    """Run on vectors, the contributors' random and the extra participants' NaN (nothing of
    theirs may be added or sent on): every holder ends with the contributors' sum of its
    targets. Where extras take part, the bytes sent are the cost model's."""
    rng = np.random.default_rng(0)
    order = target_order(reduction, machine)
    assert sorted(order) == list(range(len(reduction.targets)))
    n = sum(reduction.targets[t][0].volume for t in order)
    vectors = {rank: rng.integers(-9, 9, n).astype(float) for rank in reduction.summed_from}
    total = sum(vectors.values())
    vectors |= {r: np.full(n, np.nan) for r in reduction.participants if r not in vectors}
    built = schedule(reduction, machine)
    held = _run(built, vectors)
    if reduction.contributors:
        sent = sum(built.sent(reduction.itemsize).values())
        assert sent == reduction_cost(reduction, machine)[1]
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
        # without latency a ring is never slower than a tree or halving-doubling
        # (`collective_prices.allreduce_algorithm`)
        assert list(schedule(reduction, Machine(latency_us=0.0))) == expected
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


@pytest.mark.parametrize("p", [2, 3, 8, 13, 64])
def test_an_allreduce_runs_as_a_tree_where_latency_outweighs_its_bytes(p):
    """A normalization's few scales over many ranks go up a binomial tree and back down,
    2⌈log2 p⌉ rounds rather than the ring's 2(p − 1), with the same bytes on the wire as the
    cost model counts, and priced as the fastest; a large gradient keeps the ring where the
    ranks are not a power of two (halving-doubling would move it whole to fold them), and goes
    by halving-doubling where they are (the ring's bytes in 2·log2 p rounds)."""
    machine = Machine()  # 2 µs a message, 12.5 GB/s
    ranks = tuple(range(p))
    power = p & (p - 1) == 0
    large = 2 * int(math.log2(p)) if power and p > 2 else 2 * (p - 1)
    for elements, rounds in ((64, 2 * math.ceil(math.log2(p))), (2**24, large)):
        reduction = Reduction("g", "allreduce", ranks, ((Rect((0,), (elements,)), ranks),), 4)
        built = schedule(reduction, machine)
        if p == 2:  # one level: the tree moves each byte one way at a time, the ring both ways
            rounds = 2
            assert not any(hop.lo == 0 and hop.hi == elements for hop in built[0])
        assert len(built) == rounds
        seconds, wire = collective_cost("allreduce", p, elements * 4, 0, machine)
        assert sum(built.sent(4).values()) == wire
        nbytes, a = elements * 4, machine.alpha
        ring = 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * machine.ring_beta
        tree = 2 * math.ceil(math.log2(p)) * (a + nbytes * machine.beta)
        powers = 2 ** int(math.log2(p))
        halving = 2 * math.log2(powers) * a + 2 * (powers - 1) / powers * nbytes * machine.ring_beta
        if powers < p:
            halving += 2 * (a + nbytes * machine.beta)
        assert seconds == pytest.approx(min(ring, tree, halving), rel=1e-12)
        assert (seconds < ring) == (rounds < 2 * (p - 1))


@pytest.mark.parametrize("p", [4, 5, 8, 12, 784])
def test_halving_doubling_exchanges_a_bit_at_a_time_nearest_first(p):
    """Halving-doubling's rounds: the ranks beyond the largest power of two p' fold into the
    first of each leading pair and are copied the sum at the end; in between, log2 p' rounds
    of halving (adding) and log2 p' of doubling (copying), each a pairwise exchange with the
    rank one bit of its place away among those that halve, nearest bit first, the halves
    shrinking by two each round and growing back."""
    n = 1 << 12
    ranks = tuple(range(100, 100 + p))
    reduction = Reduction("g", "allreduce", ranks, ((Rect((0,), (n,)), ranks),), 4)
    machine = Machine(latency_us=50.0)
    assert allreduce_algorithm(p, n * 4, machine)[0] == "halving"
    built = schedule(reduction, machine)
    powers = 2 ** int(math.log2(p))
    folded, levels = p - powers, int(math.log2(powers))
    halving = [*ranks[0 : 2 * folded : 2], *ranks[2 * folded :]]
    rounds = list(built)
    if folded:
        fold, unfold = rounds[0], rounds[-1]
        rounds = rounds[1:-1]
        pairs = [(ranks[2 * i + 1], ranks[2 * i]) for i in range(folded)]
        assert [(h.src, h.dst, h.lo, h.hi, h.add) for h in fold] == [
            (*x, 0, n, True) for x in pairs
        ]
        assert [(h.src, h.dst, h.lo, h.hi, h.add) for h in unfold] == [
            (d, s, 0, n, False) for s, d in pairs
        ]
    assert len(rounds) == 2 * levels
    for k, hops in enumerate(rounds):
        bit = k if k < levels else 2 * levels - 1 - k
        assert len(hops) == powers
        for v, hop in enumerate(hops):
            assert (hop.src, hop.dst) == (halving[v], halving[v ^ (1 << bit)])
            assert hop.hi - hop.lo == n >> (bit + 1) and hop.add == (k < levels)


def _tree_reference(ranks, owner, n):
    """A binomial tree's levels hop by hop: at level k, the rank 2^k·(2j + 1) places past the
    owner sends its vector to the rank 2^k places before it; then the same hops walked back."""
    p, root = len(ranks), ranks.index(owner)
    up = []
    step = 1
    while step < p:
        up.append(
            [Hop(ranks[(root + r) % p], ranks[(root + r - step) % p], 0, n, True)
             for r in range(step, p, 2 * step)]
        )  # fmt: skip
        step *= 2
    down = [[Hop(h.dst, h.src, h.lo, h.hi, False) for h in hops] for hops in reversed(up)]
    return up, down


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 70), st.data())
def test_a_tree_is_its_levels_up_and_back_down(p, data):
    """Small vectors go by a tree (`collective_prices.allreduce_algorithm`, `reduce_by_tree`): a reduce to its
    owner, and an all-reduce to the first participant and back down the same hops."""
    ranks = tuple(data.draw(st.permutations(range(80)))[:p])
    owner = data.draw(st.sampled_from(ranks))
    n = data.draw(st.integers(1, 8))
    machine = Machine()
    assert reduce_by_tree(p, n * 4, machine)
    reduce = Reduction("g", "reduce", ranks, ((Rect((0,), (n,)), (owner,)),), 4)
    assert list(schedule(reduce, machine)) == _tree_reference(ranks, owner, n)[0]
    allreduce = Reduction("g", "allreduce", ranks, ((Rect((0,), (n,)), ranks),), 4)
    up, down = _tree_reference(ranks, ranks[0], n)
    if allreduce_algorithm(p, n * 4, machine)[0] == "tree":  # not where another has fewer rounds
        assert list(schedule(allreduce, machine)) == up + down


@pytest.mark.parametrize("p", [3, 4, 6, 8, 13])
def test_a_reduce_scatter_halves_where_latency_outweighs_its_bytes(p):
    """Over many ranks and small shares a reduce-scatter halves (`collective_prices.reduce_scatter_algorithm`):
    log2 p' rounds of pairwise exchanges, and where p is not a power of two a round to fold
    the extra ranks in (each sends all but its own share) and one to give them their share
    back; the ring's (p − 1)·n elements on the wire either way, as the cost model counts. Its
    targets lie in the vector by the chunk each owner ends with, so each holds its sum."""
    machine = Machine(latency_us=50.0)
    ranks = tuple(range(10, 10 + p))
    sizes = [3 + k % 4 for k in range(p)]
    edges = np.cumsum([0, *sizes])
    targets = tuple(
        (Rect((int(lo),), (int(hi),)), (rank,)) for lo, hi, rank in zip(edges, edges[1:], ranks)
    )
    reduction = Reduction("g", "reduce_scatter", ranks, targets, 4)
    built = schedule(reduction, machine)
    powers = 2 ** int(math.log2(p))
    folded = powers < p
    if p == 3:  # the fold costs more than the ring's one round it saves
        assert len(built) == p - 1
        assert target_order(reduction, machine) == list(range(p))
        return
    assert len(built) == int(math.log2(powers)) + 2 * folded
    n = int(edges[-1])
    seconds, wire = collective_cost("reduce_scatter", p, n * 4, max(sizes) * 4, machine)
    assert sum(built.sent(4).values()) == wire == (p - 1) * n * 4
    ring = (p - 1) * (machine.alpha + max(sizes) * 4 * machine.ring_beta)
    assert seconds < ring
    order = target_order(reduction, machine)
    assert sorted(order) == list(range(p)) and order != list(range(p))
    rng = np.random.default_rng(p)
    vectors = {rank: rng.integers(-9, 9, n).astype(float) for rank in ranks}
    held = _run(built, vectors)
    total = sum(vectors.values())
    offset = 0
    for t in order:
        rect, (owner,) = targets[t]
        np.testing.assert_array_equal(
            held[owner][offset : offset + rect.volume], total[offset : offset + rect.volume]
        )
        offset += rect.volume


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 19),
    st.integers(0, 5),
    st.data(),
    st.sampled_from([Machine(), Machine(latency_us=0.0), Machine(latency_us=50.0)]),
)
def test_an_allgather_leaves_every_owners_part_with_every_receiver(p, extras, data, machine):
    """An all-gather's schedule, by whichever algorithm the machine prices least, run on vectors
    in which each participant holds only its own parts (NaN elsewhere), leaves every receiver
    every part, from its owner; an extra participant (a holder that does not read) hands its
    parts on. On the ring among receivers alone, the bytes on the wire are the cost model's."""
    ranks = data.draw(st.permutations(range(30)))
    receivers = tuple(sorted(ranks[:p]))
    participants = tuple(sorted(ranks[: p + extras]))
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=p + extras, max_size=p + extras))
    if not any(sizes):
        sizes[0] = 1
    targets, owners, lo = [], [], 0
    for rank, size in zip(participants, sizes):  # some owners with two parts, some with none
        for part in (size // 2, size - size // 2) if size > 2 else (size,):
            if part:
                targets.append((Rect((lo,), (lo + part,)), receivers))
                owners.append(rank)
                lo += part
    reduction = Reduction("x", "allgather", participants, tuple(targets), 4, tuple(owners))
    order = target_order(reduction, machine)
    assert sorted(order) == list(range(len(targets)))
    n = lo
    whole = np.arange(n, dtype=float)
    vectors = {rank: np.full(n, np.nan) for rank in participants}
    offset = 0
    for t in order:
        rect, _ = targets[t]
        vectors[owners[t]][offset : offset + rect.volume] = whole[offset : offset + rect.volume]
        offset += rect.volume
    built = schedule(reduction, machine)
    assert not built.add.any()
    held = _run(built, vectors)
    for rank in receivers:
        np.testing.assert_array_equal(held[rank], whole)
    seconds, wire = reduction_cost(reduction, machine)
    assert seconds > 0
    if len(built) == p - 1 and participants == receivers:  # the ring: each part passes p − 1
        assert sum(built.sent(4).values()) == wire == (p - 1) * n * 4


@pytest.mark.parametrize("p", [4, 6, 8, 13, 64])
def test_an_allgather_over_many_ranks_takes_logarithmic_rounds(p):
    """Over many ranks and small parts an all-gather runs the halving reduce-scatter's rounds
    backwards: ⌈log2 p⌉ rounds where p is a power of two, two more to fold the others in and
    out, and p·log2 p hops rather than the p(p − 1) of copies from every owner."""
    machine = Machine(latency_us=50.0)
    ranks = tuple(range(p))
    targets = tuple((Rect((k,), (k + 1,)), ranks) for k in range(p))
    reduction = Reduction("x", "allgather", ranks, targets, 4, ranks)
    built = schedule(reduction, machine)
    powers = 2 ** int(math.log2(p))
    assert len(built) == int(math.log2(powers)) + 2 * (powers < p)
    assert built.hops <= p * math.ceil(math.log2(p)) + 2 * (p - powers)
    if p == 64:
        assert built.hops == 64 * 6
