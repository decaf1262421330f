"""A step of the runtime, simulated: every rank's program on a machine's links, event by event.

The cost model (`partitioner.cost`) prices a step as the sum of its tasks, each task's messages
and collectives after its compute (bulk synchronous). The runtime does better than that, and on
slow links the difference is most of the step: it posts a copy as soon as its data is written,
so a halo travels while the ranks compute what lies between producer and consumer, and it runs a
gradient's collective in the background, round by round, while the backward pass goes on below
it (`runtime.rank_step`). FlexFlow's answer is a simulator over measured task times; this is one
for legion-nn's own rank programs (`runtime.step.rank_program`), so it follows exactly the order,
post points and collective schedules the runtime runs:

- each rank runs its program's tasks in order: complete the collectives due before it (the
  program's completion points, `RankTask.complete_before`), post its partial-sum receives, wait
  for its copies, compute (the given seconds), send its partial sums, wait for those it holds,
  start its collectives, complete those due after it, post the copies due after it;
- a message moves once both ends have posted it: on a link between hosts it leaves the sending
  host's egress and then enters the receiving host's ingress (full duplex per host, a
  non-blocking switch that queues a message for a busy port), each end serving one message after
  another in the order they became ready, for latency + bytes / bandwidth (the bandwidth a
  message of its size crossed at, where `bench machine` timed the link's messages by size:
  `Machine.link_per_byte`), less the burst the link has left (`link_burst_bytes`: a token
  bucket at each end, whose bytes cross at once, refilled at the link's rate while it is idle).
  A sender whose message waits for a busy destination goes on to its next, as MPI's sends to
  several peers do (holding its egress convoyed many-to-many exchanges). Where the host's stack
  moves both directions' bytes (`Machine.stack_beta`), it takes a message's bytes at each end
  after those it took before them, and the message ends when its link and both stacks are
  through with it: a message leaves when its link is free (a stack is not a port), and one
  that meets a busy stack ends late, so two hosts exchanging b bytes both ways at once finish
  at b / the duplex rate, as `bench machine` measured them (while a lone stream runs at the
  link's rate); within a host, latency + bytes / bandwidth of the host's own link (shared
  memory);
- MPI progress: a collective's next round is posted only when the rank calls into MPI. While it
  waits (for a message or a collective) it polls, so a round that completes then is followed at
  once; while it computes, the next round waits for the end of the task. Data already posted
  moves in the background, but between hosts, while a kernel runs at its destination, no
  faster than that rank's progress thread takes it in (`Links.computing_rate`: each of its
  calls reads what the socket's buffer holds): from a kernel's start to its end the
  transfers its rank receives cross at that rate at most (each transfer's bytes spread
  evenly over its time), but for what one call takes in (`Links.held`),
  which crosses first at its own speed, and after the kernel at their own speed again; a
  transfer that is held back holds its link till it ends, so the next message on that link
  waits for it. A transfer leaving a rank in a kernel is held the same way where the machine
  says (`Links.computing_send_rate`: with offloads; without, the host's core moves the bytes
  at the link's rate and the kernel waits for it instead, below);
- a rank also pays its own passes over memory around each task, as the runtime makes them
  (`local_passes`: packing a send and unpacking a receive where a staging buffer holds it,
  filling a window, zeroing a scratch, adding a partial sum in), and those of the collectives'
  hops it adds in. The runtime makes a task's passes with its progress thread on, as it runs
  its kernels, so they hold messages and share the core as a kernel does (below): a task's
  unpacking, compute and packing are stretched as one, and its adds after it;
- posting its end of a message or of a collective's hop costs a rank the machine's
  `message_overhead_us`, on its own clock (the runtime's bookkeeping and MPI calls per message);
- bytes crossing between hosts take CPU from the ranks at their ends (`network_cpu_ns_per_byte`:
  the network stack's copies, checksums and interrupts). A rank pays it only where it competes
  with a kernel or its passes: c seconds of them from t take the least s with s = c + the CPU of
  the bytes of that rank's transfers between hosts on the wire during [t, t + s] (each
  transfer's bytes spread evenly over its time on the link, held back as above;
  `rank_cpu.sharing_core`, `rank_cpu.held_spread`). The
  bytes that cross while the stack holds the kernel back cost the core too, so where the
  transfers would take the whole core the kernel waits for them. While a rank waits, the stack
  has the core;
- ranks beyond their host's cores time-share them (`Machine.core_share`): all of a rank's CPU
  work above (compute, packing, adding, posting, the stack's) takes 1/share as long, since each
  was measured with the rank alone on its cores.

The step ends when every rank has finished its last task, completed its collectives and seen its
sends off. Events are processed in time order (a heap), so the links serve messages in the order
they became ready, as a FIFO queue would.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

from partitioner.machine import Machine
from runtime.step.links import Links
from runtime.step.local_passes import PassPrices, TaskPasses, passes_alone
from runtime.step.rank_cpu import (
    cpu_slowdown,
    held_back,
    held_spread,
    kernel_share,
    sharing_core,
)
from runtime.step.rank_messages import Message
from runtime.step.rank_program import Collective, RankProgram
from runtime.step.simulated_step import SimulatedStep

Key = tuple  # ("m", seq) for a message, ("h", seq) for a collective's hop


@dataclass
class _Transfer:
    src: int
    dst: int
    nbytes: int
    send_posted: float | None = None
    recv_posted: float | None = None
    #: when it starts and ends on the link, once both ends have posted it
    start: float | None = None
    end: float | None = None


@dataclass(eq=False)  # each is itself: two alike in flight are two collectives
class _Running:
    """A rank's collective in flight: the keys of each round that concern this rank."""

    rounds: list[list[Key]]
    adds: list[int]  # bytes added at the end of each round
    round: int = 0
    #: time the current round's last transfer ends, once all of them are scheduled
    round_end: float | None = None


_SYNC = "sync"  # the rank's clock moved on: resume it when the simulation gets there
_PROGRESS = "progress"  # a call into MPI between tasks: collectives move on


class _Simulator:
    def __init__(
        self,
        programs: Mapping[int, RankProgram],
        compute: Mapping[int, Sequence[float]],
        machine: Machine,
        links: Links | None = None,
        passes: Mapping[int, TaskPasses] | None = None,
    ) -> None:
        self.programs = programs
        self.compute = compute
        self.links = links or Links.of(machine, max(programs) + 1)
        prices = PassPrices.of(machine)
        #: seconds a byte of a collective's hop added in, and per message or hop posted
        self.add = prices.add
        self.per_message = prices.per_message
        #: per rank, its own passes around each task (`local_passes`)
        self.passes = passes or passes_alone(programs, prices)
        self.network_cpu = machine.network_cpu_seconds_per_byte
        #: per rank, how much longer its CPU work takes than alone on its cores
        self.slowdown = cpu_slowdown(machine, programs)
        #: per rank, its transfers between hosts in the order they were scheduled, those ended
        #: before its clock dropped (`_stretched`)
        self.on_wire: dict[int, list[_Transfer]] = {rank: [] for rank in programs}
        #: per rank, when its latest kernel ends (its messages between hosts held back till then)
        self.computing_until: dict[int, float] = {rank: 0.0 for rank in programs}
        #: (rate, bytes at once) of a held message a computing rank receives (True) or sends
        self.held = {receives: self.links.held(receives) for receives in (True, False)}
        self.transfers: dict[Key, _Transfer] = {}
        #: when each host's link (or, within a host, each rank) is next free, each way
        self.egress: dict[tuple[str, int], float] = defaultdict(float)
        self.ingress: dict[tuple[str, int], float] = defaultdict(float)
        #: the burst each host's link has left when it is next free, each way (full at first)
        self.tokens: dict[tuple[str, tuple[str, int]], float] = {}
        #: when each host's network stack is next free (`Links.stack_beta`)
        self.stack: dict[int, float] = defaultdict(float)
        self.clock = {rank: 0.0 for rank in programs}
        self.waiting = {rank: 0.0 for rank in programs}
        self.computing = {rank: 0.0 for rank in programs}
        self.timeline: list[tuple[int, int, float, float]] = []
        self.running: dict[int, list[_Running]] = {rank: [] for rank in programs}
        #: per rank, every collective it started, in start order (`RankTask.complete_before`)
        self.started: dict[int, list[_Running]] = {rank: [] for rank in programs}
        self.sends: dict[int, list[Key]] = {rank: [] for rank in programs}
        #: per rank, the keys it is blocked on (None while it runs)
        self.blocked: dict[int, list[Key] | None] = {rank: None for rank in programs}
        self.events: list[tuple[float, int, int]] = []
        self.wake_at: dict[int, float] = {}
        self.counter = itertools.count()
        self.done: dict[int, float] = {}
        self.threads = {rank: self._program(rank) for rank in programs}

    # -- links ---------------------------------------------------------------------------------

    def _transfer(self, key: Key, src: int, dst: int, nbytes: int) -> _Transfer:
        found = self.transfers.get(key)
        if found is None:
            found = self.transfers[key] = _Transfer(src, dst, nbytes)
        return found

    def _post(self, rank: int, key: Key, now: float) -> None:
        transfer = self.transfers[key]
        if rank == transfer.src:
            transfer.send_posted = now
            self.sends[rank].append(key)
        if rank == transfer.dst:
            transfer.recv_posted = now
        if transfer.send_posted is not None and transfer.recv_posted is not None:
            self._schedule(transfer, now)

    def _schedule(self, transfer: _Transfer, ready: float) -> None:
        links = self.links
        src_host, dst_host = links.host(transfer.src), links.host(transfer.dst)
        between = src_host != dst_host
        if not between:  # shared memory: each rank copies one message at a time
            out, into = ("rank", transfer.src), ("rank", transfer.dst)
            alpha = links.alpha_intra
        else:
            out, into = ("host", src_host), ("host", dst_host)
            alpha = links.alpha
        beta, stack_beta = (float(rate[0]) for rate in links.rates([transfer.nbytes], [between]))
        start = max(ready, self.egress[out])
        if not between:  # a copy in shared memory holds both ranks; the switch queues the rest
            start = max(start, self.ingress[into])
        arrive = max(start, self.ingress[into])
        paid = transfer.nbytes
        if links.burst and between:
            # a token bucket at each end: what the emptier has left crosses at once, the rest
            # at the rate; it refills at the rate while the link is idle
            ends = (("out", out, self.egress[out], start), ("in", into, self.ingress[into], arrive))
            left = min(
                min(
                    links.burst, self.tokens.get((way, end), links.burst) + (at - free) / links.beta
                )
                for way, end, free, at in ends
            )
            paid = max(transfer.nbytes - left, 0.0)
            for way, end, _, _ in ends:
                self.tokens[way, end] = max(left - transfer.nbytes, 0.0)
        transfer.start = start
        self.egress[out] = start + alpha + paid * beta
        if links.stack_beta and between:
            # each end's stack takes the bytes as they cross, after what it took before them
            self.stack[src_host] = max(start, self.stack[src_host]) + paid * stack_beta
            self.stack[dst_host] = max(arrive, self.stack[dst_host]) + paid * stack_beta
            transfer.end = alpha + max(
                arrive + paid * beta, self.stack[src_host], self.stack[dst_host]
            )
        else:
            transfer.end = arrive + alpha + paid * beta
        self.ingress[into] = transfer.end
        if between and links.holds:
            # held back while a kernel runs at its destination, then at its source
            end = transfer.end
            for rank, receives in ((transfer.dst, True), (transfer.src, False)):
                until = self.computing_until.get(rank, 0.0)
                end = held_back(start, end, transfer.nbytes, start, until, *self.held[receives])
            self._put_back(transfer, end)
        if between:
            for rank in (transfer.src, transfer.dst):
                if rank in self.on_wire:
                    self.on_wire[rank].append(transfer)
        for rank in (transfer.src, transfer.dst):
            if self.blocked.get(rank) is not None:
                self._wake(rank, transfer.end)

    def _ends(self, keys: Sequence[Key]) -> float | None:
        """When the last of `keys` ends, or None while some is not scheduled."""
        latest = 0.0
        for key in keys:
            transfer = self.transfers[key]
            if transfer.end is None:
                return None
            latest = max(latest, transfer.end)
        return latest

    # -- collectives ---------------------------------------------------------------------------

    def _start_collective(self, rank: int, collective: Collective) -> None:
        itemsize = collective.reduction.itemsize
        rounds: list[list[Key]] = []
        adds: list[int] = []
        seq = collective.seq
        for hops in collective.rounds:
            mine: list[Key] = []
            added = 0
            for hop in hops:
                key = ("h", seq)
                seq += 1
                self._transfer(key, hop.src, hop.dst, (hop.hi - hop.lo) * itemsize)
                if rank in (hop.src, hop.dst):
                    mine.append(key)
                if hop.dst == rank and hop.add:
                    added += (hop.hi - hop.lo) * itemsize
            rounds.append(mine)
            adds.append(added)
        running = _Running(rounds, adds)
        self.running[rank].append(running)
        self.started[rank].append(running)
        self._post_round(rank, running)

    def _post_round(self, rank: int, running: _Running) -> None:
        keys = running.rounds[running.round] if running.round < len(running.rounds) else []
        self.clock[rank] += len(keys) * self.per_message * self.slowdown[rank]
        for key in keys:
            self._post(rank, key, self.clock[rank])

    def _advance(self, rank: int) -> None:
        """Post the next round of each of `rank`'s collectives whose round has ended by now."""
        now = self.clock[rank]
        for running in self.running[rank]:
            while running.round < len(running.rounds):
                end = self._ends(running.rounds[running.round])
                if end is None or end > now:
                    break
                self.clock[rank] += running.adds[running.round] * self.add * self.slowdown[rank]
                running.round += 1
                self._post_round(rank, running)

    def _next_round_end(self, rank: int) -> float | None:
        ends = [
            self._ends(r.rounds[r.round]) for r in self.running[rank] if r.round < len(r.rounds)
        ]
        future = [end for end in ends if end is not None and end > self.clock[rank]]
        return min(future, default=None)

    # -- ranks ---------------------------------------------------------------------------------

    def _wake(self, rank: int, at: float) -> None:
        """Resume `rank` at `at`, unless it is already due earlier: a rank has one live event
        (others are left in the heap as stale), and each wake re-reads what it waits for."""
        if at < self.wake_at.get(rank, math.inf):
            self.wake_at[rank] = at
            heapq.heappush(self.events, (at, next(self.counter), rank))

    def _messages(self, rank: int, messages: Sequence[Message]) -> None:
        for m in messages:
            self._transfer(("m", m.seq), m.src, m.dst, m.nbytes)
            self._post(rank, ("m", m.seq), self.clock[rank])

    def _program(self, rank: int) -> Generator[object, None, None]:
        """The rank's step. It yields `_SYNC` when its clock has moved on, `_PROGRESS` at a
        call into MPI between tasks, and a list of keys to wait for (polling meanwhile)."""
        program = self.programs[rank]
        passes, slow = self.passes[rank], self.slowdown[rank]
        self.clock[rank] += passes.at_start * slow
        yield _SYNC
        self._messages(rank, program.post_at_start)
        for position, rt in enumerate(program.tasks):
            yield from self._complete(rank, [self.started[rank][o] for o in rt.complete_before])
            self.clock[rank] += passes.before_copies[position] * slow
            self._messages(rank, rt.partial_in)
            yield [("m", m.seq) for m in rt.copies_in]
            before = passes.after_copies[position] * slow
            kernel = self.compute[rank][position]
            busy = before + kernel + passes.after_compute[position] * slow
            start = self.clock[rank]
            took = self._stretched(rank, busy)
            if kernel:
                kernel_start = start + kernel_share(took, before, busy)
                kernel_took = kernel_share(took, kernel, busy)
                self.computing[rank] += kernel_took
                self.timeline.append((rank, position, kernel_start, kernel_start + kernel_took))
            self.clock[rank] += took
            yield _SYNC
            self._messages(rank, rt.partial_out)
            self.clock[rank] += self._stretched(rank, passes.after_partial_out[position] * slow)
            yield [("m", m.seq) for m in rt.partial_in]
            self.clock[rank] += self._stretched(rank, passes.after_partial_in[position] * slow)
            for collective in rt.collectives:
                self._start_collective(rank, collective)
            yield from self._complete(rank, [self.started[rank][o] for o in rt.complete_after])
            self._messages(rank, rt.post)
            yield _PROGRESS
        yield from self._complete(rank, list(self.running[rank]))
        yield list(self.sends[rank])

    def _stretched(self, rank: int, seconds: float) -> float:
        """`seconds` of compute from the rank's clock on, with the network stack's CPU for the
        bytes of its transfers between hosts on the wire meanwhile, which move no faster than
        its progress thread moves them till it ends (see the module docstring)."""
        if not self.network_cpu and not self.links.holds:
            return seconds
        begin = self.clock[rank]
        wire = self.on_wire[rank] = [t for t in self.on_wire[rank] if t.end > begin]
        if seconds == 0.0:
            return 0.0  # no kernel runs
        took = seconds
        if self.network_cpu:
            took = sharing_core(
                seconds,
                self.network_cpu * self.slowdown[rank],
                [
                    held_spread(t.start, t.end, t.nbytes, begin, *self.held[t.dst == rank])
                    for t in wire
                ],
            )
        if self.links.holds:
            until = self.computing_until[rank] = begin + took
            for t in wire:
                held = self.held[t.dst == rank]
                self._put_back(t, held_back(t.start, t.end, t.nbytes, begin, until, *held))
        return took

    def _put_back(self, transfer: _Transfer, end: float) -> None:
        """`transfer` (between hosts) ends at `end`, no earlier than it would: its link moves
        its bytes till then, and what comes after it on the link waits for that."""
        if end == transfer.end:
            return
        transfer.end = end
        out = ("host", self.links.host(transfer.src))
        into = ("host", self.links.host(transfer.dst))
        self.egress[out] = max(self.egress[out], end)
        self.ingress[into] = max(self.ingress[into], end)

    def _complete(self, rank: int, due: list[_Running]) -> Generator[object, None, None]:
        """Complete the rank's collectives `due`, one after another, as the runtime does at the
        program's completion points (`RankTask.complete_before`); the others stay in flight."""
        for running in due:
            while running.round < len(running.rounds):  # `_advance` moves it on meanwhile
                yield list(running.rounds[running.round])
            self.running[rank].remove(running)

    def _run(self, rank: int) -> None:
        """Go on with `rank` at its clock until it waits, syncs or ends."""
        thread = self.threads[rank]
        while True:
            try:
                op = next(thread)
            except StopIteration:
                self.done[rank] = self.clock[rank]
                return
            if op is _SYNC:
                self._wake(rank, self.clock[rank])
                return
            if op is _PROGRESS:
                self._advance(rank)
                continue
            keys: list[Key] = op  # type: ignore[assignment]
            for key in keys:
                if key not in self.transfers:  # posted by the peer alone so far
                    raise AssertionError(f"rank {rank} waits for {key}, never posted")
            self.blocked[rank] = keys
            self._poll(rank, self.clock[rank])
            return

    def _poll(self, rank: int, now: float) -> None:
        """`rank` is blocked: at `now`, follow its collectives' rounds, and go on if its wait
        is over, else sleep until the next end it knows of."""
        waited_from = self.clock[rank]
        self.clock[rank] = max(self.clock[rank], now)
        self._advance(rank)
        now = self.clock[rank]
        transfers = self.transfers
        # what has ended is dropped, so that a long wait (the step's last, on every send) is
        # not read again at every wake
        keys = [k for k in self.blocked[rank] if transfers[k].end is None or transfers[k].end > now]
        self.waiting[rank] += now - waited_from
        if not keys:
            self.blocked[rank] = None
            self._run(rank)
            return
        self.blocked[rank] = keys
        end = self._ends(keys)
        wake = [t for t in (end, self._next_round_end(rank)) if t is not None]
        if wake:
            self._wake(rank, min(wake))

    def run(self) -> SimulatedStep:
        for rank in self.programs:
            self._wake(rank, 0.0)
        while self.events:
            at, _, rank = heapq.heappop(self.events)
            if self.wake_at.get(rank) != at:
                continue
            del self.wake_at[rank]
            if rank in self.done:
                continue
            if self.blocked[rank] is not None:
                self._poll(rank, at)
            else:
                self.clock[rank] = max(self.clock[rank], at)
                self._run(rank)
        stuck = sorted(set(self.programs) - set(self.done))
        if stuck:
            raise RuntimeError(f"step simulation: ranks {stuck} never finished (a deadlock)")
        return SimulatedStep(
            max(self.done.values(), default=0.0),
            dict(self.done),
            self.waiting,
            self.timeline,
            self.computing,
        )


def simulate_step(
    programs: Mapping[int, RankProgram],
    compute: Mapping[int, Sequence[float]],
    machine: Machine,
    links: Links | None = None,
    passes: Mapping[int, TaskPasses] | None = None,
) -> SimulatedStep:
    """The step of every rank's `programs`, with `compute[rank][i]` seconds for the i-th task
    of its program (kernels and the runtime's per-task cost), on `machine`'s links (or
    `links`), each rank's own passes over memory around its tasks as `passes` gives them
    (default: `local_passes.passes_alone`, every copy staged)."""
    return _Simulator(programs, compute, machine, links, passes).run()
