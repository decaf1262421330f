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

Ranks are flattened in parts (`flat_part`: some ranks' instructions, each START naming the
collective it starts), which `runtime.step.flat_step.merged` makes one step of, so that
processes may flatten shares of a step's ranks apart (`runtime.step.simulated_in_shares`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress

import numpy as np

from runtime.step.flat_step import FlatPart, FlatStep, merged
from runtime.step.links import Links
from runtime.step.local_passes import TaskPasses
from runtime.step.loop import ADD, COMPLETE, COMPUTE, POST, PROGRESS, START, SYNC, WAIT
from runtime.step.rank_messages import Message, facts_of, seq_of, src_of
from runtime.step.rank_program import Collective, RankProgram
from runtime.step.shared_programs import (
    built,
    facts_of_programs,
    own_collectives,
    own_messages,
    source,
)


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
        #: the facts of the messages told the ranks, where the programs were built with them
        #: (`shared_programs.facts_of_programs`); else the messages posted (a message both of
        #: whose ends are among the ranks, twice), whose facts are read from them
        self.facts = facts_of_programs(programs)
        self.posted: list[Message] = []
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
        if self.facts is None:
            self.posted += messages

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
            lo, hi = self._add_keys(list(map(seq_of, messages)))
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
            self.wait(list(map(seq_of, messages)))
            if messages:
                patches.append((len(self.ops) - 1, WAIT, messages))

        at_start = program.post_at_start
        if own is not None:
            at_start = [own[m.seq] for m in at_start]
        self.add(passes.at_start * slow)
        self.ops.append((SYNC, 0, 0))
        post(at_start)
        sends = _sent_by(rank, at_start)
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
                sends += _sent_by(rank, partial_out) + _sent_by(rank, posted)
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
            mine = list(map(own.__getitem__, map(seq_of, what)))
            if code == POST:
                self._messages(mine)
                self.posts += len(mine)
            ops[at] = (code, *self._add_keys(list(map(seq_of, mine))))
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
        facts = self._posted_facts(ranks)
        return FlatPart(
            list(ranks),
            np.concatenate(self.op_chunks) if self.op_chunks else np.zeros((0, 3), np.int64),
            np.asarray(op_ptr, np.int64),
            np.asarray(self.amounts, np.float64),
            np.asarray(self.keys, np.int64),
            self.started,
            *facts.T,
            self.sends,
            max((p.messages for p in built(self.programs)), default=0),
            self.posts,
            self.waits,
        )

    def _posted_facts(self, ranks: Sequence[int]) -> np.ndarray:
        """The sequence number, source, destination and bytes of each message the ranks post:
        from the facts told them, those with an end among `ranks`; else read off the messages
        posted, in one pass over each (its fields one after another fetched it four times: a
        rank's messages lie scattered in memory, and a share of vgg19's model plan on 1024
        ranks posts 5 million)."""
        if self.facts is not None:
            ends = self.facts[:, 1:3]
            among = np.zeros(max(int(ends.max(initial=0)), max(ranks, default=0)) + 1, bool)
            among[list(ranks)] = True
            return self.facts[among[ends[:, 0]] | among[ends[:, 1]]]
        return np.fromiter(
            chain.from_iterable(map(facts_of, self.posted)), np.int64, 4 * len(self.posted)
        ).reshape(-1, 4)


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


def _own(
    own: Mapping[int, Message], lists: Sequence[Sequence[Message]]
) -> tuple[list[Message], ...]:
    """Each of `lists` of messages, each message the rank's own (`shared_programs.own_messages`)."""
    return tuple(list(map(own.__getitem__, map(seq_of, messages))) for messages in lists)


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


def _sent_by(rank: int, messages: Sequence[Message]) -> list[Message]:
    """Those of `messages` that `rank` sends, in order."""
    return list(compress(messages, map(rank.__eq__, map(src_of, messages))))
