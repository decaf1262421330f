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

A reduce-scatter whose owners include ranks that add nothing (a classifier's 1,000 outputs
summed into the 2,048 parts of the layer below), and an all-gather whose holders include ranks
that read nothing, run among the ranks that do, p of them (`Reduction.core_places`), plus a
round of α + bβ in which partners hand the extras their sums or take their parts, b the most
one partner hands or takes.

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
    if reduction.gathers or reduction.algorithm == "reduce_scatter":
        return _core_cost(reduction, machine)
    return collective_cost(
        reduction.algorithm, len(reduction.participants), reduction.nbytes, 0, machine
    )


def owned_elements(reduction: Reduction) -> np.ndarray:
    """Per position among the ranks a reduce-scatter or an all-gather runs among
    (`Reduction.core_places`), the elements of its targets it ends (or starts) with: its own
    and its extras'."""
    core, effective = reduction.core_places
    position = {rank: i for i, rank in enumerate(core)}
    owned = np.zeros(len(position), np.int64)
    for (rect, _), owner in zip(reduction.targets, effective):
        owned[position[owner]] += rect.volume
    return owned


def _handed_elements(reduction: Reduction) -> dict[int, int]:
    """Per partner of extra participants (`Reduction.core_places`), the elements of the
    extras' targets it hands them or takes from them."""
    core, effective = reduction.core_places
    inside = set(core)
    handed: dict[int, int] = {}
    for (rect, _), owner, partner in zip(reduction.targets, reduction.target_owners, effective):
        if owner not in inside:
            handed[partner] = handed.get(partner, 0) + rect.volume
    return handed


def _core_cost(reduction: Reduction, machine: Machine) -> tuple[float, int]:
    """A reduce-scatter's or an all-gather's: the algorithm's over the ranks it runs among
    (`Reduction.core_places`), with a round more where extra participants receive their sums
    from partners among them, or hand their parts to them first, as long as the busiest
    partner's link takes."""
    core, _ = reduction.core_places
    n = reduction.nbytes
    owned = owned_elements(reduction)
    largest = int(owned.max()) * reduction.itemsize if len(owned) else 0
    seconds, wire = collective_cost(reduction.algorithm, len(core), n, largest, machine)
    handed = _handed_elements(reduction)
    if handed:
        seconds += machine.alpha + max(handed.values()) * reduction.itemsize * machine.beta
        wire += sum(handed.values()) * reduction.itemsize
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
    reduce: np.ndarray,
    p: np.ndarray,
    n: np.ndarray,
    largest: np.ndarray,
    machine: Machine,
    handed_most: np.ndarray | None = None,
    handed_total: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`reduction_cost` of many collectives at once, float for float: collective k is a
    `reduce` where `reduce[k]`, else a `reduce_scatter` among `p[k]` contributors, whose
    partners hand its extra participants (`Reduction.core_places`) `handed_total[k]` bytes,
    the most any one partner `handed_most[k]`."""
    p, n, largest = (np.asarray(x, np.int64) for x in (p, n, largest))
    less = p - 1
    ring_scatter, halving = _reduce_scatter_seconds(p, n, largest, machine)
    scatter = np.where(_halving_wins(p, ring_scatter, halving), halving, ring_scatter)
    tree, ring = _reduce_seconds(p, n, machine)
    by_tree = tree <= ring
    seconds = np.where(reduce, np.where(by_tree, tree, ring), scatter)
    wire = np.where(reduce & ~by_tree, 2 * less * n, less * n)
    none = (p < 2) | (n == 0)
    seconds, wire = np.where(none, 0.0, seconds), np.where(none, 0, wire)
    if handed_most is not None:
        handed = handed_most > 0
        seconds = np.where(handed, seconds + (machine.alpha + handed_most * machine.beta), seconds)
        wire = wire + handed_total
    return seconds, wire
