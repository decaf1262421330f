"""The prices of the plan's collectives (`partitioner.collectives` runs what these price), over
p participants and n bytes:

- `allreduce`, the best of a ring 2(p−1)α + 2(p−1)/p·nβ, halving-doubling 2·log2 p'·α +
  2(p'−1)/p'·nβ over the largest power of two p' ≤ p (plus 2(α + nβ) to fold the others in and
  out) and a binomial tree's reduce then broadcast 2⌈log2 p⌉(α + nβ);
- `reduce_scatter`, the better of a ring (p−1)α + (p−1)·bβ with b the largest owner's share and
  halving log2 p'·α + (p'−1)·bβ (2b for blocks two folded ranks share, plus 2α + nβ to fold);
- `reduce` to one owner, the better of a binomial tree ⌈log2 p⌉(α + nβ) and reduce-scatter then
  gather 2(p−1)α + 2(p−1)/p·nβ;
- `allgather`, a reduce-scatter's hops run backwards (`collectives`), so the better of the
  same ring and halving, its local passes a copy of the rank's own share into the flat vector
  and of the vector out (2 bytes a byte) rather than adds.

The bytes sent are those each algorithm puts on the wire, summed. Where the machine prices
memory traffic, a collective also pays its local passes: every add reads two operands and
writes one (3 bytes a byte); an all-reduce sums the gradient in place; the others first zero
and fill a flat vector (3n) and finally add the rank's share into the tensor (3 bytes a byte
again).
"""

from __future__ import annotations

import math

import numpy as np

from partitioner.machine import Machine
from partitioner.task_plan import ALLGATHER, Reduction


def reduction_cost(reduction: Reduction, machine: Machine) -> tuple[float, int]:
    """(seconds, bytes on the wire) of one collective."""
    if reduction.gathers:
        return _gather_cost(reduction, machine)
    p = len(reduction.participants)
    n = reduction.nbytes
    largest = 0
    if reduction.algorithm == "reduce_scatter" and p >= 2 and n:
        largest = int(owned_elements(reduction).max()) * reduction.itemsize
    return collective_cost(reduction.algorithm, p, n, largest, machine)


def owned_elements(reduction: Reduction) -> np.ndarray:
    """Per participant's position, the elements of a reduce-scatter's targets it owns after
    (each target's one holder); for an all-gather, per position among the ranks that receive
    it (`gather_places`), the elements each gathers from (its own and its extras')."""
    if reduction.gathers:
        receivers, effective = gather_places(reduction)
        ranks = receivers
    else:
        ranks = reduction.participants
        effective = [holders[0] for _, holders in reduction.targets]
    position = {rank: i for i, rank in enumerate(ranks)}
    owned = np.zeros(len(position), np.int64)
    for (rect, _), owner in zip(reduction.targets, effective):
        owned[position[owner]] += rect.volume
    return owned


def gather_places(reduction: Reduction) -> tuple[tuple[int, ...], list[int]]:
    """(the ranks an all-gather leaves holding every target, and per target the one of them
    it leaves from): a target's owner where the owner is one of them; else the owner is an
    extra participant, which holds parts but does not read them, and first hands its parts to
    a partner among them, the k-th extra to the (k mod r)-th of the r."""
    receivers = reduction.targets[0][1]
    inside = set(receivers)
    extras = [rank for rank in reduction.participants if rank not in inside]
    partner = {rank: receivers[k % len(receivers)] for k, rank in enumerate(extras)}
    return receivers, [partner.get(owner, owner) for owner in reduction.owners]


def _gather_cost(gather: Reduction, machine: Machine) -> tuple[float, int]:
    """An all-gather's (`allgather_algorithm` over the ranks that receive it, after a round in
    which the extra participants hand their parts to partners among them: `gather_places`)."""
    receivers, _ = gather_places(gather)
    n = gather.nbytes
    owned = owned_elements(gather)
    largest = int(owned.max()) * gather.itemsize if len(owned) else 0
    seconds, wire = collective_cost(ALLGATHER, len(receivers), n, largest, machine)
    inside = set(receivers)
    handed: dict[int, int] = {}  # per extra participant, the elements it hands on
    for (rect, _), owner in zip(gather.targets, gather.owners):
        if owner not in inside:
            handed[owner] = handed.get(owner, 0) + rect.volume
    if handed:
        seconds += machine.alpha + max(handed.values()) * gather.itemsize * machine.beta
        wire += sum(handed.values()) * gather.itemsize
    return seconds, wire


def collective_cost(
    algorithm: str, p: int, n: int, largest: int, machine: Machine
) -> tuple[float, int]:
    """(seconds, bytes on the wire) of a collective of `algorithm` over `p` participants and
    `n` bytes; `largest` is, for a reduce-scatter, the largest owner's share of them."""
    if p < 2 or n == 0:
        return 0.0, 0
    if algorithm == "allreduce":
        return allreduce_algorithm(p, n, machine)[1], 2 * (p - 1) * n
    if algorithm == "reduce_scatter":
        return reduce_scatter_algorithm(p, n, largest, machine)[1], (p - 1) * n
    if algorithm == ALLGATHER:
        return allgather_algorithm(p, n, largest, machine)[1], (p - 1) * n
    tree, ring = _reduce_seconds(p, n, machine)
    return (tree, (p - 1) * n) if tree <= ring else (ring, 2 * (p - 1) * n)


def _reduce_seconds(p, n, machine: Machine):
    """(binomial tree, reduce-scatter then gather) seconds of a reduce of `n` bytes over `p`
    ranks to one owner; `p` and `n` numbers, or arrays of many reduces (`collective_costs`)."""
    a, b, m = machine.alpha, machine.beta, machine.seconds_per_memory_byte
    levels = np.ceil(np.log2(np.maximum(p, 1)))
    tree = levels * (a + n * b) + (6 * n + 3 * levels * n) * m
    ranks = np.maximum(p, 1)
    ring = (
        2 * (p - 1) * a
        + 2 * (p - 1) / ranks * n * machine.ring_beta
        + (6 * n + 3 * (p - 1) / ranks * n) * m
    )
    return tree, ring


def _allreduce_seconds(p: int, n: int, machine: Machine) -> dict[str, float]:
    """Seconds of an all-reduce of `n` bytes over `p` ranks, in place, by each algorithm, in
    the order `allreduce_algorithm` prefers them where they price alike. The tree reduces to
    one rank and broadcasts back down, ⌈log2 p⌉ rounds each of whole vectors, every rank
    sending or receiving in a round, and adds at most once a round; the ring's 2(p − 1) steps
    each send and receive a chunk at once (`Machine.ring_beta`); halving-doubling
    (Rabenseifner's) folds the p − p' ranks beyond the largest power of two p' into partners (a
    whole vector one way, then back at the end) and halves, then doubles, the vector among the
    p' others in 2·log2 p' exchanges: the ring's bytes in far fewer rounds. The tree's latency
    wins on small vectors (a normalization's scales), halving-doubling on many ranks, the
    ring's bandwidth on large vectors over ranks that are not a power of two, as MPI libraries
    choose (MPICH's all-reduce)."""
    a, m = machine.alpha, machine.seconds_per_memory_byte
    levels = math.ceil(math.log2(p))
    tree = 2 * levels * (a + n * machine.beta) + 3 * levels * n * m
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n * machine.ring_beta + 3 * (p - 1) / p * n * m
    powers = 1 << (p.bit_length() - 1)
    halving = (
        2 * (powers.bit_length() - 1) * a
        + 2 * (powers - 1) / powers * n * machine.ring_beta  # the ring's sums, bit for bit
        + 3 * (powers - 1) / powers * n * m
    )
    if powers < p:
        halving += 2 * (a + n * machine.beta) + 3 * n * m
    return {"ring": ring, "halving": halving, "tree": tree}


def _may_halve(p):
    """Whether a collective over `p` ranks (a number or an array of them) may run by halving: not
    on two, where halving is the ring's own hops, which priced apart might round apart."""
    return np.asarray(p) > 2


def allreduce_algorithm(p: int, n: int, machine: Machine) -> tuple[str, float]:
    """(the algorithm, "ring", "halving" or "tree", and its seconds) an all-reduce of `n` bytes
    over `p` ranks runs: the one `_allreduce_seconds` prices least (`collectives.schedule` runs
    what this prices)."""
    seconds = _allreduce_seconds(p, n, machine)
    if not _may_halve(p):
        del seconds["halving"]
    name = min(seconds, key=seconds.__getitem__)
    return name, seconds[name]


def _reduce_scatter_seconds(p, n, largest, machine: Machine, gathers: bool = False):
    """(ring, halving) seconds of a reduce-scatter of `n` bytes over `p` ranks whose largest
    owner's share is `largest` bytes; numbers, or arrays of many (`collective_costs`). The
    ring's p − 1 steps each send and receive a share at once (`Machine.ring_beta`); halving
    (`collectives`) folds the p − p' ranks beyond the largest power of two p' into partners
    (each sends what it does not own, and gets its share's sum back) and halves the vector
    log2 p' times among the others: a half of round k holds p'/2^(k+1) of their blocks, each
    at most `largest` bytes, or twice that where two ranks share a block. Both zero and fill a
    flat vector (3n) and add each share into its tensor (3 bytes a byte). An all-gather
    (`gathers`) runs the same hops backwards, copying rather than adding: its own share into
    the vector, then the vector out (2 bytes a byte each)."""
    a, b, m = machine.alpha, machine.beta, machine.seconds_per_memory_byte
    both = machine.ring_beta
    local = 2 * n + 2 * largest if gathers else 3 * n + 3 * p * largest
    fold = (2 if gathers else 3) * n * m
    ring = (p - 1) * (a + largest * both) + local * m
    powers = np.exp2(np.floor(np.log2(np.maximum(p, 1))))
    folded = powers < p
    block = np.where(folded, 2 * largest, largest)
    halving = np.log2(powers) * a + (powers - 1) * block * both + local * m
    halving = halving + np.where(folded, 2 * a + n * b + fold, 0.0)
    return ring, halving


def reduce_scatter_algorithm(p: int, n: int, largest: int, machine: Machine) -> tuple[str, float]:
    """(the algorithm, "ring" or "halving", and its seconds) a reduce-scatter of `n` bytes over
    `p` ranks, the largest owner's share `largest`, runs: the one `_reduce_scatter_seconds`
    prices less, the ring where they tie (on two ranks they are the same hops)."""
    ring, halving = (float(x) for x in _reduce_scatter_seconds(p, n, largest, machine))
    return ("halving", halving) if _halving_wins(p, ring, halving) else ("ring", ring)


def allgather_algorithm(p: int, n: int, largest: int, machine: Machine) -> tuple[str, float]:
    """(the algorithm, "ring" or "halving", and its seconds) an all-gather of `n` bytes over
    `p` ranks, the largest owner's share `largest`, runs: as `reduce_scatter_algorithm` decides,
    priced with copies for adds."""
    ring, halving = (float(x) for x in _reduce_scatter_seconds(p, n, largest, machine, True))
    return ("halving", halving) if _halving_wins(p, ring, halving) else ("ring", ring)


def _halving_wins(p, ring, halving):
    """Whether a reduce-scatter over `p` ranks whose ring and halving take `ring` and `halving`
    seconds (numbers, or arrays of many) halves: where it may, and prices less."""
    return _may_halve(p) & (halving < ring)


def reduce_by_tree(p: int, n: int, machine: Machine) -> bool:
    """Whether a reduce of `n` bytes over `p` ranks to one owner runs as a binomial tree rather
    than a reduce-scatter then a gather (`collectives.schedule` runs what this prices)."""
    tree, ring = _reduce_seconds(p, n, machine)
    return tree <= ring


def collective_costs(
    reduce: np.ndarray, p: np.ndarray, n: np.ndarray, largest: np.ndarray, machine: Machine
) -> tuple[np.ndarray, np.ndarray]:
    """`collective_cost` of many collectives at once, float for float: collective k is a
    `reduce` where `reduce[k]`, else a `reduce_scatter`."""
    p, n, largest = (np.asarray(x, np.int64) for x in (p, n, largest))
    less = p - 1
    ring_scatter, halving = _reduce_scatter_seconds(p, n, largest, machine)
    scatter = np.where(_halving_wins(p, ring_scatter, halving), halving, ring_scatter)
    tree, ring = _reduce_seconds(p, n, machine)
    by_tree = tree <= ring
    seconds = np.where(reduce, np.where(by_tree, tree, ring), scatter)
    wire = np.where(reduce & ~by_tree, 2 * less * n, less * n)
    none = (p < 2) | (n == 0)
    return np.where(none, 0.0, seconds), np.where(none, 0, wire)
