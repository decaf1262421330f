"""A collective in flight on one rank: its rounds of hops, posted as each completes.

`rank_step.StepRun` starts one per collective a task runs (`partitioner.collectives` gives the
schedule) and moves it on between tasks and while it waits; the step completes it at the
program's completion points (`RankProgram.completions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from runtime.step.buffers import hop_segment
from runtime.step.rank_program import Collective, RankTask
from runtime.tracing import COMMUNICATION
from runtime.transport import done, wait

if TYPE_CHECKING:
    from legion_nn.rect import Rect
    from runtime.tracing import Recorder
    from runtime.transport import Transport


class StepRun(Protocol):
    """What a collective needs of the step that runs it (`rank_step.StepRun`)."""

    rank: int
    transport: Transport
    recorder: Recorder | None
    step_label: int | str
    stall_timeout: float

    def now(self) -> float: ...

    def buffer(self, key: tuple, shape, dtype, zero: bool = False) -> np.ndarray: ...

    def view(self, tensor: str, rect: Rect) -> np.ndarray: ...

    def advance_collectives(self, skip: RunningCollective | None = None) -> None: ...


class RunningCollective:
    """A collective in flight: its rounds of hops, posted one after another as each completes.

    Hops send straight from the vector and a round waits for its sends as well as its receives,
    since a later round (or an add in this one) may overwrite what was sent. A hop that only
    copies receives straight into the vector. Between the step's tasks, `advance` moves it on
    without blocking; `complete` blocks until the last round is in, then adds the result into
    the tensor (unless it was reduced in place), or, for an all-gather, copies in the parts
    other ranks own. Until then no task touches the tensor: the
    step completes a collective before any task that does."""

    def __init__(
        self, run: StepRun, rt: RankTask, collective: Collective, vector: np.ndarray
    ) -> None:
        self.run = run
        self.rt = rt
        self.collective = collective
        self.tensor = collective.reduction.tensor
        self.vector = vector
        self.round = 0
        self.seq = collective.seq
        self.pending: list[tuple[Any, int]] = []
        self.adds: list[tuple[Any, np.ndarray]] = []
        self.started = run.now()
        #: when the last round came in, for the trace (the step may complete it much later)
        self.finished = self.started

    @property
    def what(self) -> str:
        reduction = self.collective.reduction
        return (
            f"step {self.run.step_label}, task {self.rt.task.name} ({reduction.algorithm} of "
            f"{self.tensor} over ranks {list(reduction.participants)})"
        )

    def post_round(self) -> None:
        run, vector = self.run, self.vector
        self.pending, self.adds = [], []
        segment = hop_segment(vector.itemsize)
        for hop in self.collective.rounds[self.round]:
            tag = run.transport.data_tag(self.seq)
            if hop.src == run.rank:
                # an adding hop goes in segments, in order under one tag (`Adding`)
                step = segment if hop.add else hop.hi - hop.lo
                for lo in range(hop.lo, hop.hi, max(step, 1)):
                    hi = min(lo + step, hop.hi)
                    self.pending.append((run.transport.isend(vector[lo:hi], hop.dst, tag), hop.dst))
            if hop.dst == run.rank:
                if hop.add:  # one buffer per add of a round serves every round
                    key = ("hop", self.collective.seq, len(self.adds))
                    size = min(hop.hi - hop.lo, segment)
                    buffer = run.buffer(key, (size,), vector.dtype)
                    self.adds.append(Adding(run, hop, tag, vector, buffer, self.what))
                else:
                    request = run.transport.irecv(vector[hop.lo : hop.hi], hop.src, tag)
                    self.pending.append((request, hop.src))
            self.seq += 1

    def _end_round(self) -> None:
        self.round += 1
        if self.round < len(self.collective.rounds):
            self.post_round()
        else:
            self.finished = self.run.now()

    def _round_done(self) -> bool:
        rank, what = self.run.rank, self.what
        added = [adding.advance() for adding in self.adds]
        return all(added) and all(done(request, peer, what, rank) for request, peer in self.pending)

    def advance(self) -> None:
        while self.round < len(self.collective.rounds) and self._round_done():
            self._end_round()

    def complete(self) -> None:
        run = self.run
        reduction = self.collective.reduction
        while self.round < len(self.collective.rounds):
            for adding in self.adds:
                while not adding.advance():
                    adding.wait(lambda: run.advance_collectives(skip=self))
            wait(
                self.pending,
                self.what,
                run.rank,
                run.stall_timeout,
                lambda: run.advance_collectives(skip=self),
            )
            self._end_round()
        offset = 0
        owners = self.collective.owners
        for t, (rect, holders) in enumerate(self.collective.targets):
            size = rect.volume
            if run.rank in holders:
                target = run.view(self.tensor, rect)
                part = self.vector[offset : offset + size].reshape(target.shape)
                if owners:
                    if owners[t] != run.rank:  # a gathered part, copied over what was there
                        target[...] = part
                elif not np.may_share_memory(target, self.vector):  # else reduced in place
                    target += part
            offset += size
        if run.recorder is None:
            return
        run.recorder.add(
            "collective",
            f"{reduction.algorithm} {self.tensor}",
            COMMUNICATION,
            self.started,
            self.finished,
            {
                "step": run.step_label,
                "task": self.rt.task.name,
                "tensor": self.tensor,
                "bytes": reduction.nbytes,
                "algorithm": reduction.algorithm,
                "participants": list(reduction.participants),
            },
        )


class Adding:
    """An adding hop received into one buffer of at most `hop_segment` elements, a segment at a
    time, each added into the vector as it arrives: the sender sends the segments in order under
    one tag, which both transports deliver in order. So a collective's receive buffers stay a
    segment long however long its hops are."""

    def __init__(
        self, run: StepRun, hop, tag: int, vector: np.ndarray, buffer: np.ndarray, what: str
    ) -> None:
        self.run, self.hop, self.tag, self.what = run, hop, tag, what
        self.vector, self.buffer = vector, buffer
        self.lo = hop.lo
        self._post()

    def _post(self) -> None:
        size = min(len(self.buffer), self.hop.hi - self.lo)
        self.request = self.run.transport.irecv(self.buffer[:size], self.hop.src, self.tag)

    def advance(self) -> bool:
        """Add in every segment that has arrived; whether the hop is complete."""
        run = self.run
        while self.lo < self.hop.hi and done(self.request, self.hop.src, self.what, run.rank):
            size = min(len(self.buffer), self.hop.hi - self.lo)
            self.vector[self.lo : self.lo + size] += self.buffer[:size]
            self.lo += size
            if self.lo < self.hop.hi:
                self._post()
        return self.lo >= self.hop.hi

    def wait(self, on_idle: Callable[[], None]) -> None:
        run = self.run
        wait([(self.request, self.hop.src)], self.what, run.rank, run.stall_timeout, on_idle)
