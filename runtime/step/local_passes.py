"""A rank's own passes over memory around each task of its step, priced as the runtime makes
them (`runtime.rank_step.RankStep`): both step simulators (`runtime.step.simulator` and the
compiled loop) read the seconds from here, so they price them alike.

Around each task, in the runtime's order:

- before its copies are awaited: the partial sums it receives are posted (`pack`);
- after its copies arrive: each copy received into a staging buffer is copied where the task
  reads it, its windows' home parts are copied in, the rects it sums into are zeroed, and so is
  each scratch its pieces reduce into (`buffers.Staging`: a copy received straight into its
  window, and a reduction summed in place, make none);
- after its kernels: the partial sums it sends and the copies it posts next are copied into
  send buffers (a copy sent straight from its home is not) and posted;
- after its partial sums are posted: the parts of its contribution it keeps are added into its
  own copy (`RankTask.local_parts`);
- after the partial sums it receives arrive: each is added in.

A copy, an add and a zeroing are priced by the bytes they move at the rates `bench machine`
measured the runtime's NumPy passes at (`Machine.buffer_seconds_per_byte`). Traced on seed-lcn's
sharded data plan on two ranks, the passes around the classifier's gradient (a 283 MB half of a
566 MB weight) took 25 ms to fill its window, 39 ms to zero its scratch and 21-31 ms to add the
kept half in, none of which the step had priced, and 17-80 ms to pack the half sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.rect import Rect
from partitioner.machine import Machine
from runtime.instances import StorageOrder
from runtime.step.buffers import Staging, staging
from runtime.step.rank_messages import Message, dst_of, nbytes_of, src_of
from runtime.step.rank_program import RankProgram


@dataclass(frozen=True)
class PassPrices:
    """Seconds a byte of the runtime's passes (`Machine.buffer_seconds_per_byte`) and per message
    posted (`Machine.message_overhead`)."""

    copy: float
    add: float
    zero: float
    per_message: float

    @classmethod
    def of(cls, machine: Machine) -> PassPrices:
        rate = machine.buffer_seconds_per_byte
        return cls(rate("copy"), rate("add"), rate("zero"), machine.message_overhead)


@dataclass(frozen=True)
class TaskPasses:
    """Per task position of a rank's program, seconds of its own passes at each point of the
    step (see the module docstring), and those of posting the copies due at its start."""

    at_start: float
    before_copies: Sequence[float]
    after_copies: Sequence[float]
    after_compute: Sequence[float]
    after_partial_out: Sequence[float]
    after_partial_in: Sequence[float]


def posting_seconds(
    messages: Sequence[Message], rank: int, prices: PassPrices, direct: frozenset[int]
) -> float:
    """Seconds for `rank` to copy its sends among `messages` into send buffers (all but the
    `direct` ones, sent from their home) and to post its ends of them."""
    if not messages:
        return 0.0
    sending = list(map(rank.__eq__, map(src_of, messages)))  # in C: 10⁴ messages a task
    ends = sending.count(True) + list(map(dst_of, messages)).count(rank)
    sent = compress(messages, sending)
    if direct:
        sent = (m for m in sent if m.seq not in direct)
    return sum(map(nbytes_of, sent)) * prices.copy + ends * prices.per_message


def task_passes(
    program: RankProgram,
    rank: int,
    prices: PassPrices,
    graph: TaskGraph | None = None,
    layouts: dict[str, StorageOrder] | None = None,
) -> TaskPasses:
    """The passes of `rank`, which runs `program` (its own, or its class's moved to it: the
    seconds are the same). Without `graph` (a program made by hand) every copy is staged and
    nothing else is priced: no windows, zeroings or kept parts."""
    staged: Staging | None = staging(graph, program, layouts) if graph is not None else None
    direct = staged.direct if staged is not None else frozenset()

    def nbytes(tensor: str, rects: Iterable[Rect]) -> int:
        return sum(r.volume for r in rects) * np.dtype(graph.tensors[tensor].dtype).itemsize

    def post(messages: Sequence[Message]) -> float:
        return posting_seconds(messages, rank, prices, direct)

    before, after_copies, after_compute, kept, after_partial = [], [], [], [], []
    for rt in program.tasks:
        before.append(post(rt.partial_in))
        received = [m for m in rt.copies_in if m.seq not in direct] if direct else rt.copies_in
        seconds = sum(map(nbytes_of, received)) * prices.copy
        zeroed = 0.0
        if staged is not None:
            for tensor, parts in rt.window_home.items():
                seconds += nbytes(tensor, parts) * prices.copy
            for tensor, rect in rt.zero_first:
                zeroed += nbytes(tensor, [rect])
            for tensor, rect in staged.scratch[rt.index].items():
                zeroed += nbytes(tensor, [rect])
        after_copies.append(seconds + zeroed * prices.zero)
        after_compute.append(post(rt.partial_out) + post(rt.post))
        if staged is not None:
            parts = rt.local_parts.items()
            kept.append(sum(nbytes(tensor, rects) for tensor, rects in parts) * prices.add)
        else:
            kept.append(0.0)
        after_partial.append(sum(map(nbytes_of, rt.partial_in)) * prices.add)
    return TaskPasses(
        post(program.post_at_start), before, after_copies, after_compute, kept, after_partial
    )


def passes_alone(programs: Mapping[int, RankProgram], prices: PassPrices) -> dict[int, TaskPasses]:
    """Each rank's passes where the simulators are given none (programs made by hand, without
    their graph: `task_passes`)."""
    return {rank: task_passes(program, rank, prices) for rank, program in programs.items()}
