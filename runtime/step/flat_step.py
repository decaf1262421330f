"""A step's instructions as the compiled loop reads them (`FlatStep`), and how they are made
from parts flattened apart (`FlatPart`, `runtime.step.compiled.flat_part`).

Ranks are flattened in parts, each START naming the collective it starts, and the parts merged
(`merged`): each moved past the ones before, each START bound to its rank's instance of the
collective, each rank's last wait made. The instances are bound in the order one part of every
rank meets them, so every way of cutting the ranks into parts gives the same instructions
(`tests/runtime/step/test_simulated_in_shares.py`), and processes may flatten shares of a step's
ranks apart (`runtime.step.simulated_in_shares`).

A collective's rounds are flattened per participant with NumPy (a rank's keys in every round,
in hop order, and the bytes it adds at the end of each), not hop by hop in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.step.links import Links
from runtime.step.loop import ADD, COMPUTE, POST, START, SYNC, WAIT
from runtime.step.rank_program import Collective


@dataclass
class FlatStep:
    """Every rank's program as instructions, and the transfers and collectives they name."""

    ranks: list[int]
    #: per rank index, its instructions are ops[op_ptr[i]:op_ptr[i + 1]], each (code, a, b)
    ops: np.ndarray
    op_ptr: np.ndarray
    #: ADD's amounts (by a); POST's and WAIT's transfers are keys[a:b]
    amounts: np.ndarray
    keys: np.ndarray
    #: per transfer (its sequence number): ends as rank indices, bytes
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    #: per rank index, its host
    host: np.ndarray
    #: per collective instance, its rounds are round_lo/hi/adds[first:first + count]
    round_first: np.ndarray
    round_count: np.ndarray
    round_lo: np.ndarray
    round_hi: np.ndarray
    round_adds: np.ndarray
    heap_room: int


@dataclass
class FlatPart:
    """The instructions of some of a step's ranks (`flat_part`), whose STARTs name the
    collectives they start (`started`) rather than instances, and whose last waits are left to
    make: what one process flattens where a step's ranks are flattened in shares
    (`runtime.step.simulated_in_shares`), merged into the step's by `merged`."""

    ranks: list[int]
    #: per rank of `ranks`, its instructions are ops[op_ptr[i]:op_ptr[i + 1]]: ADD's and
    #: COMPUTE's amounts index `amounts`, POST's and WAIT's keys `keys`, START's a `started`
    ops: np.ndarray
    op_ptr: np.ndarray
    amounts: np.ndarray
    keys: np.ndarray
    #: the collective each START starts, in the order of the instructions
    started: list[Collective]
    #: the messages the instructions post, by sequence number: their ends (ranks) and bytes
    seqs: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    #: per rank of `ranks`, its sends but its hops, on which (and its hops) its last WAIT waits
    sends: list[np.ndarray]
    #: the step's transfers (messages and hops) as the programs count them
    transfers: int
    posts: int
    waits: int


class _Merged:
    """The step's instructions from its parts' (`merged`): each part's moved past the ones
    before, each START bound to its rank's instance of the collective, each rank's last wait
    made."""

    def __init__(self, parts: Sequence[FlatPart]) -> None:
        self.ranks = [rank for part in parts for rank in part.ranks]
        self.index = np.full(max(self.ranks, default=-1) + 1, -1, np.int64)
        self.index[self.ranks] = np.arange(len(self.ranks))
        transfers = max((part.transfers for part in parts), default=0)
        self.src = np.full(transfers, -1, np.int64)
        self.dst = np.full(transfers, -1, np.int64)
        self.nbytes = np.zeros(transfers, np.int64)
        self.key_arrays: list[np.ndarray] = []
        self.key_count = 0
        #: per collective (by sequence number): its participants' instances
        self.instances: dict[int, dict[int, int]] = {}
        self.round_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.round_first: list[int] = []
        self.round_count: list[int] = []
        self.rounds_total = 0
        #: per collective, the rank index sending each of its hops and the hop's sequence
        #: number, in hop order (for each rank's last wait, on every send)
        self.hop_sends: list[tuple[np.ndarray, np.ndarray]] = []
        self.posts = 0

    def lookup(self, ranks: np.ndarray) -> np.ndarray:
        """Each rank's index among the ranks simulated, -1 for one not simulated."""
        ranks = np.asarray(ranks, np.int64)
        found = np.full(len(ranks), -1, np.int64)
        inside = (ranks >= 0) & (ranks < len(self.index))
        found[inside] = self.index[ranks[inside]]
        return found

    def _add_key_array(self, keys: np.ndarray) -> int:
        lo = self.key_count
        self.key_arrays.append(keys.astype(np.int64, copy=False))
        self.key_count += len(keys)
        return lo

    def _room(self, end: int) -> None:
        """Transfers up to sequence number `end` (a program made by hand may not count them)."""
        if end > len(self.src):
            grow = end - len(self.src)
            self.src = np.concatenate([self.src, np.full(grow, -1, np.int64)])
            self.dst = np.concatenate([self.dst, np.full(grow, -1, np.int64)])
            self.nbytes = np.concatenate([self.nbytes, np.zeros(grow, np.int64)])

    def collective(self, collective: Collective) -> dict[int, int]:
        """The instances of `collective`, one per participant simulated: each its keys in every
        round, in hop order, and the bytes it adds at each round's end (`_start_collective`)."""
        found = self.instances.get(collective.seq)
        if found is not None:
            return found
        index = self.lookup(collective.reduction.participants)
        simulated = index >= 0
        participants = np.asarray(collective.reduction.participants)[simulated].tolist()
        where = np.full(len(self.ranks), -1, np.int64)
        where[index[simulated]] = np.arange(len(participants))
        rounds = collective.rounds
        nrounds = len(rounds)
        round_of = rounds.round_of
        src, dst = self.lookup(rounds.src), self.lookup(rounds.dst)
        nbytes = (rounds.hi - rounds.lo) * collective.reduction.itemsize
        seqs = collective.seq + np.arange(rounds.hops, dtype=np.int64)
        self._room(collective.seq + rounds.hops)
        self.src[seqs], self.dst[seqs], self.nbytes[seqs] = src, dst, nbytes
        # one entry per (rank, hop) the rank is an end of, once even where it is both
        hop = np.arange(rounds.hops, dtype=np.int64)
        both = dst != src
        ends = np.concatenate([src, dst[both]])
        hop_of = np.concatenate([hop, hop[both]])
        slot = where[ends] if len(ends) else ends
        kept = (ends >= 0) & (slot >= 0)
        slot, hop_of = slot[kept], hop_of[kept]
        cell = slot * nrounds + round_of[hop_of]
        order = np.lexsort((hop_of, cell))
        cells = len(participants) * nrounds
        counts = np.bincount(cell, minlength=cells)
        lo = self.key_count + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._add_key_array(seqs[hop_of[order]])
        adding = rounds.add & (dst >= 0)
        adding &= np.where(dst >= 0, where[np.maximum(dst, 0)], -1) >= 0
        added = np.zeros(cells, np.int64)
        if adding.any():
            target = where[dst[adding]] * nrounds + round_of[adding]
            np.add.at(added, target, nbytes[adding])
        self.round_parts.append((lo, lo + counts, added))
        first = len(self.round_first)
        mine = dict(zip(participants, range(first, first + len(participants))))
        self.round_first += [self.rounds_total + k * nrounds for k in range(len(participants))]
        self.round_count += [nrounds] * len(participants)
        self.rounds_total += cells
        sending = np.flatnonzero((src >= 0) & (where[np.maximum(src, 0)] >= 0))
        self.hop_sends.append((src[sending], seqs[sending]))
        self.instances[collective.seq] = mine
        self.posts += 2 * rounds.hops
        return mine

    def flat(self, parts: Sequence[FlatPart], links: Links) -> FlatStep:
        chunks, amounts, ptrs, sends = [], [], [np.zeros(1, np.int64)], []
        amount_count = ops_count = waits = 0
        for part in parts:  # every part's keys first: the collectives' rounds add theirs after
            ops = part.ops.copy()
            code = ops[:, 0]
            ops[code == ADD, 1] += amount_count
            ops[code == COMPUTE, 1:] += amount_count
            keyed = (code == POST) | (code == WAIT)
            ops[keyed, 1:] += self.key_count
            self._add_key_array(part.keys)
            amount_count += len(part.amounts)
            amounts.append(part.amounts)
            if len(part.seqs):
                self._room(int(part.seqs.max()) + 1)
                self.src[part.seqs] = self.lookup(part.src)
                self.dst[part.seqs] = self.lookup(part.dst)
                self.nbytes[part.seqs] = part.nbytes
            chunks.append(ops)
            ptrs.append(part.op_ptr[1:] + ops_count)
            ops_count += len(ops)
            sends += part.sends
            self.posts += part.posts
            waits += part.waits
        ops = np.concatenate(chunks) if chunks else np.zeros((0, 3), np.int64)
        op_ptr = np.concatenate(ptrs)
        # bound in the order met, rank by rank: each collective's instances numbered as one
        # process flattening every rank would number them
        starting = np.flatnonzero(ops[:, 0] == START)
        rank_of = (np.searchsorted(op_ptr, starting, side="right") - 1).tolist()
        ranks, instances, bound = self.ranks, self.instances, []
        for collective in (c for part in parts for c in part.started):
            mine = instances.get(collective.seq)
            if mine is None:
                mine = self.collective(collective)
            bound.append(mine[ranks[rank_of[len(bound)]]])
        ops[starting, 1] = bound
        self._last_waits(ops, op_ptr, sends)
        keys = np.concatenate(self.key_arrays) if self.key_arrays else np.zeros(0, np.int64)
        if self.round_parts:
            round_lo = np.concatenate([p[0] for p in self.round_parts])
            round_hi = np.concatenate([p[1] for p in self.round_parts])
            round_adds = np.concatenate([p[2] for p in self.round_parts])
        else:
            round_lo = round_hi = round_adds = np.zeros(0, np.int64)
        syncs = int(np.count_nonzero(ops[:, 0] == SYNC)) if len(ops) else 0
        heap_room = syncs + waits + self.rounds_total + 2 * self.posts + len(self.ranks) + 1
        return FlatStep(
            self.ranks,
            ops,
            op_ptr,
            np.concatenate(amounts) if amounts else np.zeros(0, np.float64),
            keys,
            self.src,
            self.dst,
            self.nbytes,
            np.asarray([links.host(rank) for rank in self.ranks], np.int64),
            np.asarray(self.round_first, np.int64),
            np.asarray(self.round_count, np.int64),
            round_lo.astype(np.int64),
            round_hi.astype(np.int64),
            round_adds.astype(np.int64),
            heap_room,
        )

    def _last_waits(self, ops: np.ndarray, op_ptr: np.ndarray, sends: list[np.ndarray]) -> None:
        """Each rank's last wait, once every collective is bound: on every send of the rank's,
        then on the hops it sends, collective by collective in the order they were bound,
        each's in hop order (grouped by one stable sort: a ring over p ranks has 2p(p − 1)
        hops, and picking each sender's out by a scan costs p passes over them)."""
        if self.hop_sends:
            sender = np.concatenate([s for s, _ in self.hop_sends])
            order = np.argsort(sender, kind="stable")
            seqs = np.concatenate([q for _, q in self.hop_sends])[order]
            bounds = np.searchsorted(sender[order], np.arange(len(self.ranks) + 1))
        else:
            seqs, bounds = np.zeros(0, np.int64), np.zeros(len(self.ranks) + 1, np.int64)
        for i, mine in enumerate(sends):
            everything = np.concatenate([mine, seqs[bounds[i] : bounds[i + 1]]])
            lo = self._add_key_array(everything)
            ops[op_ptr[i + 1] - 1] = (WAIT, lo, lo + len(everything))


def merged(parts: Sequence[FlatPart], links: Links) -> FlatStep:
    """The step's instructions from `parts`, flattened apart (`compiled.flat_part`), their ranks in
    order: the same step as flattening every rank at once gives."""
    return _Merged(parts).flat(parts, links)
