"""The message schedules of the plan's collectives, so that runtime and accounting agree exactly.

A collective (`Reduction`) combines the participants' partial sums of a flat vector: the targets'
rects concatenated in plan order, `n` elements. Its schedule is a list of rounds; in a round every
listed hop sends elements [lo, hi) of the sender's vector to the receiver, which adds them into its
own (`add`) or overwrites them (a gathered final value). A rank starts a round only when it has
received its hops of the round before, so the rounds of a ring are its steps.

- `allreduce`, by whichever of three algorithms the machine prices least
  (`collective_prices.allreduce_algorithm`), each with 2(p − 1)·n elements on the wire:
  - a ring: a reduce-scatter of p − 1 steps, after which participant i holds the full sum of
    chunk i, then an all-gather of p − 1 steps;
  - halving-doubling (Rabenseifner's): the p − p' participants beyond the largest power of two
    p' first add their vectors into partners; the p' others halve the vector log2 p' times,
    each exchange with the partner one bit of its place away, nearest first, until each holds
    the sum of one chunk, then double it back; then the partners copy the sum out. 2·log2 p'
    rounds (and 2 to fold) where the ring takes 2(p − 1): on 784 ranks, 20 rather than 1,566;
  - where the machine's latency outweighs the vector's bytes, a binomial tree: a `reduce` to
    the first participant, then a broadcast back down the same tree, 2⌈log2 p⌉ rounds of whole
    vectors;
- `reduce_scatter`: a ring's first half, with chunk i the targets owned by participant i (empty
  for participants that own nothing), or, where the machine prices it less
  (`collective_prices.reduce_scatter_algorithm`), halving-doubling's halving, the targets laid
  out by the chunk each owner's place ends with; (p − 1)·n elements either way; where some
  owners add nothing (`Reduction.contributors`), it runs among the contributors, each such
  owner's targets laid out after a partner's own, who copies it the sums in a last round;
- `reduce` to one owner: a binomial tree, ⌈log2 p⌉ rounds of whole vectors, (p − 1)·n elements,
  unless the ring variant (reduce-scatter, then every participant sends its chunk to the owner)
  is predicted faster on the machine (`collective_prices.reduce_by_tree`, which the cost model
  prices by): large vectors over many ranks;
- `allgather` (`partitioner.gathers`): chunk i the targets participant i owns before, laid out
  as a reduce-scatter of those owners lays them; a ring's p − 1 steps, or, where the machine
  prices it less (`collective_prices.allgather_algorithm`), the halving reduce-scatter's
  rounds run backwards: each hop reversed, copying what its receiver would have summed, so
  that ⌈log2 p⌉ + 2 rounds carry what p(p − 1) copies would.

Chunks are the uneven `split_sizes(n, p)`. Hops that would carry no element are left out: they
send nothing, and counting them would make the planned bytes disagree with the bytes sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from legion_nn.rect import split_sizes
from partitioner import boxes
from partitioner.collective_prices import (
    allgather_algorithm,
    allreduce_algorithm,
    owned_elements,
    reduce_by_tree,
    reduce_scatter_algorithm,
)
from partitioner.machine import Machine
from partitioner.task_plan import Reduction


@dataclass(frozen=True)
class Hop:
    src: int
    dst: int
    lo: int
    hi: int
    add: bool


class Schedule:
    """The rounds of a collective: hop j of the flattened rounds is (src[j], dst[j], lo[j], hi[j],
    add[j]), and round r holds hops round_ptr[r]:round_ptr[r + 1]. Held as arrays, since a ring
    over p ranks has 2p(p − 1) hops (half a million for a data-parallel resnet18 on 64 ranks),
    and read as a list of rounds of `Hop`s, made on demand, by the runtime and the reference
    simulator, which walk one round at a time."""

    def __init__(self, src, dst, lo, hi, add, round_ptr) -> None:
        self.src, self.dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        self.lo, self.hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        self.add = np.asarray(add, np.bool_)
        self.round_ptr = np.asarray(round_ptr, np.int64)
        self._rounds: dict[int, list[Hop]] = {}

    @classmethod
    def of_rounds(cls, rounds: list[list[Hop]]) -> Schedule:
        hops = [hop for hops in rounds for hop in hops]
        ptr = np.concatenate([[0], np.cumsum([len(hops) for hops in rounds])]).astype(np.int64)
        columns = [
            [getattr(hop, name) for hop in hops] for name in ("src", "dst", "lo", "hi", "add")
        ]
        return cls(*columns, ptr)

    @classmethod
    def concat(cls, *parts: Schedule) -> Schedule:
        if not parts:
            return cls.of_rounds([])
        offsets = np.cumsum([0] + [part.hops for part in parts[:-1]])
        ptr = np.concatenate(
            [[0]] + [part.round_ptr[1:] + offset for part, offset in zip(parts, offsets)]
        )
        columns = [np.concatenate([getattr(part, name) for part in parts])
                   for name in ("src", "dst", "lo", "hi", "add")]  # fmt: skip
        return cls(*columns, ptr)

    @property
    def hops(self) -> int:
        return len(self.src)

    @property
    def round_of(self) -> np.ndarray:
        """Each hop's round."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.round_ptr))

    def __len__(self) -> int:
        return len(self.round_ptr) - 1

    def __getitem__(self, r: int) -> list[Hop]:
        found = self._rounds.get(r)
        if found is None:
            if not 0 <= r < len(self):
                raise IndexError(f"round {r} of {len(self)}")
            a, b = self.round_ptr[r], self.round_ptr[r + 1]
            found = self._rounds[r] = [
                Hop(int(s), int(d), int(lo), int(hi), bool(add))
                for s, d, lo, hi, add in zip(
                    self.src[a:b], self.dst[a:b], self.lo[a:b], self.hi[a:b], self.add[a:b]
                )
            ]
        return found

    def __iter__(self):
        return (self[r] for r in range(len(self)))

    def sent(self, itemsize: int) -> dict[int, int]:
        """Per rank, the bytes its hops send."""
        ranks, index = np.unique(self.src, return_inverse=True)
        totals = np.bincount(index, weights=self.hi - self.lo, minlength=len(ranks))
        return {int(r): int(t) * itemsize for r, t in zip(ranks, totals)}

    @cached_property
    def adding_sizes(self) -> dict[int, list[int]]:
        """Per receiving rank, the elements of each buffer its adding hops receive into: a
        round's k-th adding hop to a rank uses its buffer k, in every round."""
        adding = np.flatnonzero(self.add)
        if not len(adding):
            return {}
        dst, rounds = self.dst[adding], self.round_of[adding]
        order = np.lexsort((adding, rounds, dst))
        dst, rounds, size = dst[order], rounds[order], (self.hi - self.lo)[adding][order]
        group = boxes.run_starts((dst[1:] != dst[:-1]) | (rounds[1:] != rounds[:-1]))
        k = boxes.places_in_runs(group, len(dst))
        ranks, which = np.unique(dst, return_inverse=True)
        # per receiving rank (a row) and buffer k, the most any round's k-th hop brings
        sizes = np.full((len(ranks), int(k.max()) + 1), -1, np.int64)
        np.maximum.at(sizes, (which, k), size)
        return {
            rank: [v for v in row if v >= 0]  # a rank's buffers are 0..its largest k
            for rank, row in zip(ranks.tolist(), sizes.tolist())
        }


def _chunks(sizes: list[int]) -> np.ndarray:
    """(lo, hi) of consecutive chunks of these sizes, one row each."""
    ends = np.cumsum(np.asarray(sizes, np.int64))
    return np.stack([ends - np.asarray(sizes, np.int64), ends], axis=1)


def _ring(ranks: tuple[int, ...], chunks: np.ndarray, shift: int, add: bool) -> Schedule:
    """p − 1 steps of a ring: at step s, ranks[i] sends chunk (i − s − shift) mod p to
    ranks[i + 1]; hops of empty chunks are left out."""
    p = len(ranks)
    ring = np.asarray(ranks, np.int64)
    i = np.arange(p)[None, :]
    chunk = (i - np.arange(p - 1)[:, None] - shift) % p
    lo, hi = chunks[chunk, 0], chunks[chunk, 1]
    keep = hi > lo
    src = np.broadcast_to(ring[i], chunk.shape)[keep]
    dst = np.broadcast_to(ring[(i + 1) % p], chunk.shape)[keep]
    ptr = np.concatenate([[0], np.cumsum(keep.sum(axis=1))])
    return Schedule(src, dst, lo[keep], hi[keep], np.full(len(src), add), ptr)


def _ring_reduce_scatter(ranks: tuple[int, ...], chunks: np.ndarray) -> Schedule:
    """p − 1 steps after which ranks[i] holds the sum of chunks[i]."""
    return _ring(ranks, chunks, 1, True)


def _ring_allgather(ranks: tuple[int, ...], chunks: np.ndarray) -> Schedule:
    return _ring(ranks, chunks, 0, False)


def _halving_places(p: int) -> tuple[int, int, np.ndarray]:
    """(p', the largest power of two ≤ p; log2 p'; per place v among the p' ranks that halve,
    the chunk it ends with: v's bits reversed). Exchanging with the nearest partner first
    (v XOR 1) then keeps every half contiguous, and between hosts of consecutive ranks moves
    the fewest bytes."""
    powers = 1 << (p.bit_length() - 1)
    levels = powers.bit_length() - 1
    place = np.arange(powers, dtype=np.int64)
    chunk = np.zeros(powers, np.int64)
    for bit in range(levels):
        chunk |= ((place >> bit) & 1) << (levels - 1 - bit)
    return powers, levels, chunk


def _position_chunks(p: int) -> np.ndarray:
    """Per participant's position, the chunk its place among the ranks that halve ends with: the
    first p − p' pairs share a place (the second folded into the first), the others one each."""
    powers, _, chunk = _halving_places(p)
    folded = p - powers
    position = np.arange(p, dtype=np.int64)
    return chunk[np.where(position < 2 * folded, position // 2, position - folded)]


def _folded(ranks: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the first and the second of each pair folded into one place, and the ranks that halve,
    by place: each pair's first, then the ranks beyond the pairs; `_position_chunks`)."""
    ring = np.asarray(ranks, np.int64)
    folded = len(ranks) - _halving_places(len(ranks))[0]
    firsts, seconds = ring[0 : 2 * folded : 2], ring[1 : 2 * folded : 2]
    return firsts, seconds, np.concatenate([firsts, ring[2 * folded :]])


#: a round of hops as arrays: (src, dst, lo, hi, add)
_Round = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]


def _halving_rounds(halving: np.ndarray, edges: np.ndarray, gathering: bool) -> list[_Round]:
    """The rounds among the ranks that halve (`halving`, by place), chunk j of their vector
    being elements edges[j]:edges[j + 1]: halving (adding the partner's half), nearest
    partner first, or doubling back (copying its own), farthest first."""
    powers, levels, chunk = _halving_places(len(halving))
    place = np.arange(powers, dtype=np.int64)
    rounds = []
    for bit in reversed(range(levels)) if gathering else range(levels):
        half = powers >> (bit + 1)
        kept = chunk >> (levels - 1 - bit) << (levels - 1 - bit)  # the half it keeps, by chunk
        sent = kept if gathering else kept ^ half  # halving sends the partner's half
        partner = halving[place ^ (1 << bit)]
        rounds.append((halving, partner, edges[sent], edges[sent + half], not gathering))
    return rounds


def _of_rounds(rounds: list[_Round]) -> Schedule:
    """The schedule of rounds of hops as arrays, those that would carry nothing left out."""
    keep = [hi > lo for _, _, lo, hi, _ in rounds]
    src, dst, lo, hi = (
        np.concatenate([r[k][kept] for r, kept in zip(rounds, keep)])
        if rounds
        else np.zeros(0, np.int64)
        for k in range(4)
    )
    add = np.concatenate(
        [np.full(int(kept.sum()), r[4]) for r, kept in zip(rounds, keep)] or [np.zeros(0, bool)]
    )
    ptr = np.concatenate([[0], np.cumsum([int(kept.sum()) for kept in keep])]).astype(np.int64)
    return Schedule(src, dst, lo, hi, add, ptr)


def _halving_doubling(ranks: tuple[int, ...], n: int) -> Schedule:
    """Rabenseifner's all-reduce of `n` elements over `ranks` (see the module docstring): the
    folded ranks send their whole vectors in and get the whole sum back."""
    firsts, seconds, halving = _folded(ranks)
    folded = len(seconds)
    edges = np.concatenate([[0], np.cumsum(split_sizes(n, len(halving)))]).astype(np.int64)
    whole = (np.zeros(folded, np.int64), np.full(folded, n, np.int64))
    rounds = [(seconds, firsts, *whole, True)] if folded else []
    rounds += _halving_rounds(halving, edges, gathering=False)
    rounds += _halving_rounds(halving, edges, gathering=True)
    if folded:
        rounds.append((firsts, seconds, *whole, False))
    return _of_rounds(rounds)


def _halving_scatter(ranks: tuple[int, ...], owned: np.ndarray) -> Schedule:
    """A reduce-scatter by recursive halving over `ranks`, participant i owning `owned[i]`
    elements of the vector, laid out as `target_order` lays them for it (by the chunk each
    place ends with, a folded pair's shares side by side). A folded rank sends its partner all
    but its own share, and gets back the sum of the others' contributions to it, which it adds
    to its own: each of them moves n elements, as in the ring."""
    p = len(ranks)
    firsts, seconds, halving = _folded(ranks)
    folded = len(seconds)
    chunks = _position_chunks(p)
    order = np.lexsort((np.arange(p), chunks))
    start = np.zeros(p, np.int64)
    start[order] = np.concatenate([[0], np.cumsum(owned[order])[:-1]]).astype(np.int64)
    n = int(owned.sum())
    block = np.bincount(chunks, weights=owned, minlength=len(halving))
    edges = np.concatenate([[0], np.cumsum(block)]).astype(np.int64)
    own_lo = start[1 : 2 * folded : 2]
    own_hi = own_lo + owned[1 : 2 * folded : 2]
    rounds: list[_Round] = []
    if folded:
        zeros, ends = np.zeros(folded, np.int64), np.full(folded, n, np.int64)
        rounds.append((
            np.concatenate([seconds, seconds]), np.concatenate([firsts, firsts]),
            np.concatenate([zeros, own_hi]), np.concatenate([own_lo, ends]), True,
        ))  # fmt: skip
    rounds += _halving_rounds(halving, edges, gathering=False)
    if folded:
        rounds.append((firsts, seconds, own_lo, own_hi, True))
    return _of_rounds(rounds)


def _scatter_or_gather(reduction: Reduction, machine: Machine) -> Schedule:
    """A reduce-scatter's or an all-gather's rounds (`target_order` lays out its vector) among
    the ranks it runs among (`Reduction.core_places`): by recursive halving, run backwards for
    a gather, or by a ring. Extra participants hand their parts to their partners first, or
    get their sums from them last."""
    core, _ = reduction.core_places
    owned = owned_elements(reduction)
    halves = _scatter_halves(reduction, machine)
    if halves:
        body = _halving_scatter(core, owned)
        body = _backwards(body) if reduction.gathers else body
    elif reduction.gathers:
        body = _ring_allgather(core, _chunks(owned.tolist()))
    else:
        body = _ring_reduce_scatter(core, _chunks(owned.tolist()))
    extras = _extras(reduction, machine)
    if not extras:
        return body
    if reduction.gathers:
        hand = [Hop(extra, partner, lo, hi, False) for extra, lo, hi, partner in extras]
        return Schedule.concat(Schedule.of_rounds([hand]), body)
    hand = [Hop(partner, extra, lo, hi, False) for extra, lo, hi, partner in extras]
    return Schedule.concat(body, Schedule.of_rounds([hand]))


def _extras(reduction: Reduction, machine: Machine) -> list[tuple[int, int, int, int]]:
    """(extra participant, lo, hi, partner) of each extra's elements of the vector, which
    `target_order` lays out next to its partner's own (`Reduction.core_places`)."""
    core, effective = reduction.core_places
    if len(core) == len(reduction.participants):
        return []
    inside = set(core)
    owners = reduction.target_owners
    spans: dict[int, list[int]] = {}
    offset = 0
    for t in target_order(reduction, machine):
        size, owner = reduction.targets[t][0].volume, owners[t]
        if owner not in inside and size:
            span = spans.setdefault(owner, [offset, offset, effective[t]])
            span[1] = offset + size
        offset += size
    return [(extra, lo, hi, partner) for extra, (lo, hi, partner) in spans.items()]


def _backwards(summing: Schedule) -> Schedule:
    """A sum's rounds run last to first, each hop from its receiver to its sender, copying: what
    the sum left where it ends goes back to every participant. A hop that summed into its
    receiver a range the receiver went on to hold, or to pass on, now brings that range,
    complete, from there: a tree reduce's broadcast back down the tree, or a reduce-scatter's
    all-gather of the chunks it leaves its participants holding."""
    starts, ends = summing.round_ptr[:-1][::-1], summing.round_ptr[1:][::-1]
    order = (
        np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
        if len(starts)
        else np.zeros(0, np.int64)
    )
    ptr = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return Schedule(
        summing.dst[order], summing.src[order], summing.lo[order], summing.hi[order],
        np.zeros(len(order), bool), ptr,
    )  # fmt: skip


def _tree_reduce(ranks: tuple[int, ...], owner: int, n: int) -> Schedule:
    """A binomial tree to `owner`: at level k, the rank 2^k·(2j + 1) places past the owner (in
    `ranks`' order, round the ring) sends its whole vector to the rank 2^k places before it."""
    p = len(ranks)
    ring = np.asarray(ranks, np.int64)
    root = ranks.index(owner)
    steps = [1 << level for level in range(math.ceil(math.log2(p))) if p > 1]
    rel = [np.arange(step, p, 2 * step) for step in steps]
    src = np.concatenate([ring[(root + r) % p] for r in rel]) if rel else np.zeros(0, np.int64)
    dst = (
        np.concatenate([ring[(root + r - step) % p] for r, step in zip(rel, steps)])
        if rel
        else np.zeros(0, np.int64)
    )
    ptr = np.concatenate([[0], np.cumsum([len(r) for r in rel])]).astype(np.int64)
    hops = len(src)
    return Schedule(src, dst, np.zeros(hops), np.full(hops, n), np.ones(hops, bool), ptr)


def target_order(reduction: Reduction, machine: Machine) -> list[int]:
    """Indices of `reduction.targets` in the order they are laid out in the flat vector: a
    reduce-scatter's and an all-gather's by the places of the ranks they end (or start) at
    (`Reduction.core_places`) in the ring, or where they halve, by the chunk each place ends with
    (`_halving_scatter`); an extra participant's targets after its partner's own."""
    order = list(range(len(reduction.targets)))
    if reduction.gathers or reduction.algorithm == "reduce_scatter":
        core, effective = reduction.core_places
        position = {rank: i for i, rank in enumerate(core)}
        key = _chunk_keys(reduction, len(core), machine)
        handing = {rank: i + 1 for i, rank in enumerate(reduction.participants)}
        handing.update((rank, 0) for rank in core)
        owners = reduction.target_owners
        order.sort(key=lambda t: (key[position[effective[t]]], handing[owners[t]]))
    return order


def _chunk_keys(reduction: Reduction, p: int, machine: Machine) -> np.ndarray:
    """Per place among p ranks, where its chunk lies in the vector: in place order, or where
    the collective halves, by the chunk each place ends with."""
    key = np.arange(p)
    if _scatter_halves(reduction, machine):
        key = _position_chunks(p) * p + key
    return key


def _scatter_halves(reduction: Reduction, machine: Machine) -> bool:
    """Whether a reduce-scatter, or an all-gather among the ranks that receive it, runs by
    recursive halving rather than the ring."""
    owned = owned_elements(reduction)
    if len(owned) < 2 or not owned.sum():
        return False
    nbytes, largest = int(owned.sum()) * reduction.itemsize, int(owned.max()) * reduction.itemsize
    choose = allgather_algorithm if reduction.gathers else reduce_scatter_algorithm
    return choose(len(owned), nbytes, largest, machine)[0] == "halving"


def schedule(reduction: Reduction, machine: Machine) -> Schedule:
    """The rounds of hops that carry out `reduction` (element ranges of its flat vector)."""
    ranks = reduction.participants
    p = len(ranks)
    n = sum(rect.volume for rect, _ in reduction.targets)
    if p < 2 or n == 0:
        return Schedule.of_rounds([])
    if reduction.algorithm == "allreduce":
        algorithm, _ = allreduce_algorithm(p, n * reduction.itemsize, machine)
        if algorithm == "tree":
            up = _tree_reduce(ranks, ranks[0], n)
            return Schedule.concat(up, _backwards(up))
        if algorithm == "halving":
            return _halving_doubling(ranks, n)
        chunks = _chunks(split_sizes(n, p))
        return Schedule.concat(_ring_reduce_scatter(ranks, chunks), _ring_allgather(ranks, chunks))
    if reduction.algorithm == "reduce_scatter" or reduction.gathers:
        return _scatter_or_gather(reduction, machine)
    if reduction.algorithm == "reduce":
        owner = reduction.targets[0][1][0]
        if reduce_by_tree(p, n * reduction.itemsize, machine):
            return _tree_reduce(ranks, owner, n)
        chunks = _chunks(split_sizes(n, p))
        gather = [
            Hop(ranks[i], owner, int(lo), int(hi), False)
            for i, (lo, hi) in enumerate(chunks)
            if ranks[i] != owner and hi > lo
        ]
        return Schedule.concat(_ring_reduce_scatter(ranks, chunks), Schedule.of_rounds([gather]))
    raise ValueError(f"unknown collective {reduction.algorithm!r}")
