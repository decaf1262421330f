"""A message between two ranks of a step as their programs hold it (`Message`), one rank's ends
of a task's messages as its builder is told them (`MessagesTold`), and readers of a message's
fields in C, over the 10⁴ messages a model-parallel rank is told a task. `runtime.step.
rank_program` files them into a rank's program; `runtime.step.task_events` finds them.
"""

from __future__ import annotations

from operator import attrgetter
from typing import NamedTuple

from legion_nn.rect import Rect

#: copies posted at the start of the step, before any task
STEP_START = -1


class Message(NamedTuple):
    """One copy or partial sum between two ranks, numbered alike on every rank (a named tuple:
    a step of a model-parallel plan makes some 10⁵ of them, which a frozen dataclass makes three
    times slower)."""

    seq: int
    tensor: str
    rect: Rect
    src: int
    dst: int
    nbytes: int
    #: index of the task that consumes it
    task: int
    #: index of the task after which both sides post it (copies only)
    post_after: int
    reduce: bool


class MessagesTold:
    """One rank's ends of one task's messages, grouped as its builder files them
    (`rank_builder.Builder.messages`), each group in sequence order: the partial sums it sends and receives,
    the copies it receives, the copies it sends or receives by the task after which both ends
    post them, the bytes it sends, and per tensor a bounding box of the rects it receives
    (what its buffer must hold: a copy into a window aside)."""

    __slots__ = ("copies_in", "partial_in", "partial_out", "posted", "received", "sent_bytes")

    def __init__(self) -> None:
        self.partial_out: list[Message] = []
        self.partial_in: list[Message] = []
        self.copies_in: list[Message] = []
        #: (the task after which they are posted, STEP_START: the step's start; the messages)
        self.posted: list[tuple[int, list[Message]]] = []
        self.sent_bytes = 0
        #: (tensor, bounding box of rects received, whether they are partial sums)
        self.received: list[tuple[str, Rect, bool]] = []


#: a `Message`'s fields, read in C over many messages (a model-parallel rank is told 10⁴ a task)
seq_of, tensor_of, src_of, dst_of, nbytes_of = map(
    attrgetter, ("seq", "tensor", "src", "dst", "nbytes")
)
#: a `Message`'s sequence number, ends and bytes, read at once
facts_of = attrgetter("seq", "src", "dst", "nbytes")
#: a `Message`'s tensor and the position of the task that consumes it
tensor_and_task_of = attrgetter("tensor", "task")
