"""The step simulator over flat arrays, its loop compiled by Numba (`runtime.step.loop`): the
same step, faster.

`runtime.step.simulator` states the model and runs it over Python objects: a generator per rank,
a dict per transfer. That costs some 20 µs per message or collective hop, and a data-parallel
step of resnet18 on 64 ranks has half a million hops (84 rings of 126 rounds). Here each rank's
program is first flattened, in Python, into a list of instructions, each the effect of one
stretch of `_Simulator._program` between two points where it gives the clock back:

- `ADD c`: the rank's clock moves on by `c` (packing, unpacking; each sum formed exactly as the
  simulator forms it, so the clocks agree to the last bit);
- `COMPUTE c k`: CPU work of `c` seconds (a task's compute, `k` of them, and the rank's passes
  around it), stretched by the network stack's CPU for the bytes of the rank's transfers between
  hosts on the wire meanwhile (`_Simulator._stretched`);
- `SYNC`: wake me at my clock; `PROGRESS`: a call into MPI (`_advance`);
- `POST keys`, `WAIT keys`: post my ends of these transfers; block until they have ended;
- `START i`: start collective instance `i` (this rank's rounds of one collective);
- `COMPLETE i`: complete the `i`-th collective the rank started, waiting on each round;

and the compiled loop (`loop.run_step`) runs them with the simulator's very rules and
tie-breaks: one heap of (time, counter, rank) wakes with stale entries left in it, links served
in the order transfers became ready, collectives' rounds posted at MPI calls only. It returns
what `simulate_step` does, float-equal; `tests/runtime/step/test_compiled.py` holds the two
equal on every kind of plan the tests plan. A change to the model goes into both (the test
fails until it does). `prediction.simulate_compiled` is the entry point.

A collective's rounds are flattened per participant with NumPy (a rank's keys in every round,
in hop order, and the bytes it adds at the end of each), not hop by hop in Python.

Ranks are flattened in parts (`flat_part`: some ranks' instructions, each START naming the
collective it starts) and the parts merged (`merged`: each moved past the ones before, each
START bound to its rank's instance, each rank's last wait made), so that processes may flatten
shares of a step's ranks apart (`runtime.step.simulated_in_shares`). The instances are bound in
the order one part of every rank meets them, so every way of cutting the ranks into parts gives
the same instructions (`tests/runtime/step/test_simulated_in_shares.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.step.links import Links
from runtime.step.local_passes import TaskPasses
from runtime.step.loop import ADD, COMPLETE, COMPUTE, POST, PROGRESS, START, SYNC, WAIT
from runtime.step.rank_program import Collective, Message, RankProgram
from runtime.step.shared_programs import built, own_collectives, own_messages, source


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


@dataclass
class _Template:
    """One rank's instructions (`_Part.program`), to give again to a rank moved from it."""

    #: the instructions, a row (code, a, b) each
    ops: np.ndarray
    #: (position in `ops`, what to put there): POST's or WAIT's messages, each the rank's own
    #: where the template is given again
    patches: list[tuple[int, int, object]]
    #: the positions in `ops` of its STARTs, and the collective each starts, which is the
    #: rank's own where the template is given again
    start_at: np.ndarray
    started: list[Collective]
    #: the rank's sends but its hops, on which (and its hops) its last instruction waits
    sends: list[Message]
    compute: Sequence[float]
    slowdown: float
    #: the waits among `ops`
    waits: int


class _Part:
    """Flattens the programs of some ranks (`flat_part`)."""

    def __init__(
        self,
        programs: Mapping[int, RankProgram],
        passes: Mapping[int, TaskPasses],
        slowdown: Mapping[int, float],
    ) -> None:
        self.programs = programs
        self.slowdown = slowdown
        #: per rank, its own passes around each task, as the Python simulator reads them
        self.passes = passes
        #: the instructions of the rank being flattened; those of the ranks before, as arrays
        self.ops: list[tuple[int, int, int]] = []
        self.op_chunks: list[np.ndarray] = []
        self.op_count = 0
        self.amounts: list[float] = []
        self.keys: list[int] = []
        self.started: list[Collective] = []
        #: the messages posted, by sequence number
        self.messages: dict[int, Message] = {}
        self.sends: list[np.ndarray] = []
        self.waits = 0
        self.posts = 0

    def _add_keys(self, keys: list[int]) -> tuple[int, int]:
        lo = len(self.keys)
        self.keys.extend(keys)
        return lo, len(self.keys)

    def _flush_ops(self, chunk: np.ndarray | None = None) -> np.ndarray:
        """The instructions of the rank being flattened (`chunk`, else those in `ops`), kept
        as an array; `ops` is left empty for the next rank."""
        if chunk is None:
            chunk = np.asarray(self.ops, np.int64).reshape(-1, 3)
        self.ops = []
        self.op_chunks.append(chunk)
        self.op_count += len(chunk)
        return chunk

    def _messages(self, messages: Sequence[Message]) -> None:
        kept = self.messages
        for m in messages:
            kept[m.seq] = m

    def add(self, amount: float) -> None:
        if amount:  # adding zero leaves a clock as it is
            self.ops.append((ADD, len(self.amounts), 0))
            self.amounts.append(amount)

    def busy(self, amount: float, kernel: float = 0.0) -> None:
        """CPU work of `amount` seconds, stretched, of which `kernel` are a task's compute."""
        if amount:  # stretching nothing leaves a clock as it is
            self.ops.append((COMPUTE, len(self.amounts), len(self.amounts) + 1))
            self.amounts += [amount, kernel]

    def post(self, messages: Sequence[Message]) -> None:
        if messages:
            self._messages(messages)
            lo, hi = self._add_keys([m.seq for m in messages])
            self.ops.append((POST, lo, hi))
            self.posts += len(messages)

    def wait(self, keys: list[int]) -> None:
        """A wait, even on nothing: the rank polls its collectives (`_poll`)."""
        lo, hi = self._add_keys(keys)
        self.ops.append((WAIT, lo, hi))
        self.waits += 1

    def program(
        self,
        rank: int,
        program: RankProgram,
        compute: Sequence[float],
        own: Mapping[int, Message] | None = None,
        joined: Mapping[int, Collective] | None = None,
    ) -> _Template:
        """`_Simulator._program`'s instructions for `rank`, which runs `program`; where that is
        another rank's, moved (`shared_programs.source`), `own` gives `rank`'s own of its messages
        and `joined` of its collectives. Returns them as a template for the ranks moved from this
        one (`again`)."""
        slow = self.slowdown[rank]
        passes = self.passes[rank]
        waits = self.waits  # `ops` holds this rank's instructions alone (`_flush_ops`)
        patches: list[tuple[int, int, object]] = []
        start_at: list[int] = []
        started_collectives: list[Collective] = []

        def post(messages: Sequence[Message]) -> None:
            if messages:
                self.post(messages)
                patches.append((len(self.ops) - 1, POST, messages))

        def wait(messages: Sequence[Message]) -> None:
            self.wait([m.seq for m in messages])
            if messages:
                patches.append((len(self.ops) - 1, WAIT, messages))

        at_start = program.post_at_start
        if own is not None:
            at_start = [own[m.seq] for m in at_start]
        self.add(passes.at_start * slow)
        self.ops.append((SYNC, 0, 0))
        post(at_start)
        sends = [m for m in at_start if m.src == rank]
        started = 0
        for position, rt in enumerate(program.tasks):
            moved = copies_in, partial_in, partial_out, posted = (
                rt.copies_in, rt.partial_in, rt.partial_out, rt.post
            )  # fmt: skip
            if own is not None and any(moved):
                copies_in, partial_in, partial_out, posted = _own(own, moved)
            self.ops += [(COMPLETE, ordinal, 0) for ordinal in rt.complete_before]
            self.add(passes.before_copies[position] * slow)
            post(partial_in)
            wait(copies_in)
            before, kernel = passes.after_copies[position] * slow, compute[position]
            self.busy(before + kernel + passes.after_compute[position] * slow, kernel)
            self.ops.append((SYNC, 0, 0))
            post(partial_out)
            self.busy(passes.after_partial_out[position] * slow)
            wait(partial_in)
            self.busy(passes.after_partial_in[position] * slow)
            for collective in rt.collectives:
                start_at.append(len(self.ops))
                self.ops.append((START, len(self.started), 0))
                self.started.append(collective if joined is None else joined[collective.seq])
                started_collectives.append(collective)
                started += 1
            self.ops += [(COMPLETE, ordinal, 0) for ordinal in rt.complete_after]
            post(posted)
            self.ops.append((PROGRESS, 0, 0))
            if partial_out or posted:
                sends += [m for m in (*partial_out, *posted) if m.src == rank]
        due = {o for rt in program.tasks for o in (*rt.complete_before, *rt.complete_after)}
        self.ops += [(COMPLETE, o, 0) for o in range(started) if o not in due]  # the rest, in order
        self.ops.append((WAIT, 0, 0))  # made by `merged`, once every collective is bound
        self.waits += 1
        ops = self._flush_ops()
        self.sends.append(np.asarray([m.seq for m in sends], np.int64))
        return _Template(
            ops, patches, np.asarray(start_at, np.int64), started_collectives, sends, compute,
            slow, self.waits - waits,
        )  # fmt: skip

    def again(
        self,
        template: _Template,
        own: Mapping[int, Message],
        joined: Mapping[int, Collective],
    ) -> None:
        """`program`'s instructions for a rank whose program, compute and CPU share are those
        `template` was made with, moved from another rank's: the template's, each message and
        collective the rank's own."""
        ops = template.ops.copy()
        ops[template.start_at, 1] = np.arange(
            len(self.started), len(self.started) + len(template.started)
        )
        self.started += [joined[c.seq] for c in template.started]
        for at, code, what in template.patches:
            mine = [own[m.seq] for m in what]
            if code == POST:
                self._messages(mine)
                self.posts += len(mine)
            ops[at] = (code, *self._add_keys([m.seq for m in mine]))
        self._flush_ops(ops)
        self.sends.append(np.asarray([own[m.seq].seq for m in template.sends], np.int64))
        self.waits += template.waits

    def part(self, ranks: Sequence[int], compute: Mapping[int, Sequence[float]]) -> FlatPart:
        op_ptr = [0]
        #: per rank built, its instructions, given again to each rank moved from it whose
        #: compute and CPU share are its own
        templates: dict[int, _Template] = {}
        for rank in ranks:
            own = own_messages(self.programs, rank)
            joined = own_collectives(self.programs, rank)
            program = source(self.programs, rank)
            template = templates.get(program.rank) if own is not None else None
            if (
                template is not None
                and template.slowdown == self.slowdown[rank]
                and list(template.compute) == list(compute[rank])
            ):
                self.again(template, own, joined)
            else:
                made = self.program(rank, program, compute[rank], own, joined)
                if own is None:
                    templates[rank] = made
            op_ptr.append(self.op_count)
        posted = list(self.messages.values())
        return FlatPart(
            list(ranks),
            np.concatenate(self.op_chunks) if self.op_chunks else np.zeros((0, 3), np.int64),
            np.asarray(op_ptr, np.int64),
            np.asarray(self.amounts, np.float64),
            np.asarray(self.keys, np.int64),
            self.started,
            np.fromiter((m.seq for m in posted), np.int64, len(posted)),
            np.fromiter((m.src for m in posted), np.int64, len(posted)),
            np.fromiter((m.dst for m in posted), np.int64, len(posted)),
            np.fromiter((m.nbytes for m in posted), np.int64, len(posted)),
            self.sends,
            max((p.messages for p in built(self.programs)), default=0),
            self.posts,
            self.waits,
        )


def flat_part(
    programs: Mapping[int, RankProgram],
    compute: Mapping[int, Sequence[float]],
    passes: Mapping[int, TaskPasses],
    slowdown: Mapping[int, float],
    ranks: Sequence[int] | None = None,
) -> FlatPart:
    """The instructions of `ranks` (default: every rank of `programs`), each rank's CPU work
    taking `slowdown[rank]` times as long (`rank_cpu.cpu_slowdown`), `passes` its own passes
    around its tasks (`local_passes`)."""
    return _Part(programs, passes, slowdown).part(
        list(programs if ranks is None else ranks), compute
    )


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
    """The step's instructions from `parts`, flattened apart (`flat_part`), their ranks in
    order: the same step as flattening every rank at once gives."""
    return _Merged(parts).flat(parts, links)


def _own(
    own: Mapping[int, Message], lists: Sequence[Sequence[Message]]
) -> tuple[list[Message], ...]:
    """Each of `lists` of messages, each message the rank's own (`shared_programs.own_messages`)."""
    return tuple([own[m.seq] for m in messages] for messages in lists)


def flatten(
    programs: Mapping[int, RankProgram],
    compute: Mapping[int, Sequence[float]],
    links: Links,
    passes: Mapping[int, TaskPasses],
    slowdown: Mapping[int, float],
) -> FlatStep:
    """Every rank's program as instructions (see the module docstring): `passes` gives each
    rank's own passes around its tasks (`local_passes`), each rank's CPU work taking
    `slowdown[rank]` times as long (`rank_cpu.cpu_slowdown`)."""
    return merged([flat_part(programs, compute, passes, slowdown)], links)
