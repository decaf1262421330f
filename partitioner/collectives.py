"""The message schedules of the plan's collectives, so that runtime and accounting agree exactly.

A collective (`Reduction`) combines the participants' partial sums of a flat vector: the targets'
rects concatenated in plan order, `n` elements. Its schedule is a list of rounds; in a round every
listed hop sends elements [lo, hi) of the sender's vector to the receiver, which adds them into its
own (`add`) or overwrites them (a gathered final value). A rank starts a round only when it has
received its hops of the round before, so the rounds of a ring are its steps.

- `allreduce` (ring): a reduce-scatter of p − 1 steps, after which participant i holds the full
  sum of chunk i, then an all-gather of p − 1 steps; 2(p − 1)·n elements on the wire;
- `reduce_scatter` (ring): the same first half, with chunk i the targets owned by participant i
  (empty for participants that own nothing); (p − 1)·n elements;
- `reduce` to one owner: a binomial tree, ⌈log2 p⌉ rounds of whole vectors, (p − 1)·n elements,
  unless the ring variant (reduce-scatter, then every participant sends its chunk to the owner)
  is predicted faster on the machine: large vectors over many ranks.

Chunks are the uneven `split_sizes(n, p)`. Hops that would carry no element are left out: they
send nothing, and counting them would make the planned bytes disagree with the bytes sent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from legion_nn.rect import split_sizes
from partitioner.machine import Machine
from partitioner.plan import Reduction


@dataclass(frozen=True)
class Hop:
    src: int
    dst: int
    lo: int
    hi: int
    add: bool


Schedule = list[list[Hop]]


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _ring_reduce_scatter(ranks: tuple[int, ...], chunks: list[tuple[int, int]]) -> Schedule:
    """p − 1 steps after which ranks[i] holds the sum of chunks[i]."""
    p = len(ranks)
    rounds = []
    for step in range(p - 1):
        hops = []
        for i in range(p):
            lo, hi = chunks[(i - step - 1) % p]
            if hi > lo:
                hops.append(Hop(ranks[i], ranks[(i + 1) % p], lo, hi, True))
        rounds.append(hops)
    return rounds


def _ring_allgather(ranks: tuple[int, ...], chunks: list[tuple[int, int]]) -> Schedule:
    p = len(ranks)
    rounds = []
    for step in range(p - 1):
        hops = []
        for i in range(p):
            lo, hi = chunks[(i - step) % p]
            if hi > lo:
                hops.append(Hop(ranks[i], ranks[(i + 1) % p], lo, hi, False))
        rounds.append(hops)
    return rounds


def _tree_reduce(ranks: tuple[int, ...], owner: int, n: int) -> Schedule:
    p = len(ranks)
    root = ranks.index(owner)
    rounds = []
    for level in range(math.ceil(math.log2(p))):
        step = 1 << level
        hops = []
        for rel in range(step, p, 2 * step):
            src = ranks[(root + rel) % p]
            dst = ranks[(root + rel - step) % p]
            hops.append(Hop(src, dst, 0, n, True))
        rounds.append(hops)
    return rounds


def tree_is_faster(p: int, nbytes: int, machine: Machine) -> bool:
    """For a reduce to one owner: the binomial tree rather than reduce-scatter + gather."""
    a, b = machine.alpha, machine.beta
    tree = math.ceil(math.log2(p)) * (a + nbytes * b)
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * b
    return tree <= ring


def target_order(reduction: Reduction) -> list[int]:
    """Indices of `reduction.targets` in the order they are laid out in the flat vector."""
    order = list(range(len(reduction.targets)))
    if reduction.algorithm == "reduce_scatter":
        position = {rank: i for i, rank in enumerate(reduction.participants)}
        order.sort(key=lambda t: position[reduction.targets[t][1][0]])
    return order


def schedule(reduction: Reduction, machine: Machine) -> Schedule:
    """The rounds of hops that carry out `reduction` (element ranges of its flat vector)."""
    ranks = reduction.participants
    p = len(ranks)
    volumes = [reduction.targets[t][0].volume for t in target_order(reduction)]
    n = sum(volumes)
    if p < 2 or n == 0:
        return []
    if reduction.algorithm == "allreduce":
        chunks = _chunks(split_sizes(n, p))
        return _ring_reduce_scatter(ranks, chunks) + _ring_allgather(ranks, chunks)
    if reduction.algorithm == "reduce_scatter":
        owned: dict[int, int] = defaultdict(int)
        for t in target_order(reduction):
            rect, holders = reduction.targets[t]
            owned[holders[0]] += rect.volume
        chunks = _chunks([owned.get(rank, 0) for rank in ranks])
        return _ring_reduce_scatter(ranks, chunks)
    if reduction.algorithm == "reduce":
        owner = reduction.targets[0][1][0]
        if tree_is_faster(p, n * reduction.itemsize, machine):
            return _tree_reduce(ranks, owner, n)
        chunks = _chunks(split_sizes(n, p))
        gather = [
            Hop(ranks[i], owner, lo, hi, False)
            for i, (lo, hi) in enumerate(chunks)
            if ranks[i] != owner and hi > lo
        ]
        return _ring_reduce_scatter(ranks, chunks) + [gather]
    raise ValueError(f"unknown collective {reduction.algorithm!r}")
