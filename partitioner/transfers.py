"""Point-to-point messages: arrays, and read-only objects made from them.

A `Transfer` sends `rect` of `tensor` from `src` to each of `dsts`. Planning 1024 ranks makes
hundreds of thousands of them, so a plan records them as `TransferBlock`s: the transfers of one
task and tensor as arrays (rect bounds, source, a ragged array of destinations). The cost model
and the accounting read the blocks; `TransferSet.transfers()` makes `Transfer` objects from them,
in the planner's order (fetches in the order their reads first appear in the task's pieces, then
partial sums tensor by tensor), for executors and `verify_plan`. Blocks, sets and objects are
frozen and the arrays not writeable, so the objects stay views of the arrays: a changed plan is
made anew from transfers (`TransferSet.from_transfers`), and every reader sees the change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from legion_nn.rect import Rect
from partitioner import boxes


@dataclass(frozen=True)
class Transfer:
    """`rect` of `tensor` sent from `src` to each of `dsts`; `nbytes` per destination.

    A `reduce` transfer carries a partial sum that the destination adds into its copy."""

    tensor: str
    rect: Rect
    src: int
    dsts: tuple[int, ...]
    nbytes: int
    reduce: bool = False


@dataclass(frozen=True)
class TransferBlock:
    """Transfers of one tensor: transfer i sends (`lo[i]`, `hi[i]`), `nbytes[i]` bytes, from
    `src[i]` to each of `dsts[dst_ptr[i]:dst_ptr[i + 1]]`; (`major[i]`, `minor[i]`) orders it in
    the task's list."""

    tensor: str
    reduce: bool
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray
    src: np.ndarray
    dst_ptr: np.ndarray
    dsts: np.ndarray
    major: np.ndarray
    minor: np.ndarray

    def __post_init__(self) -> None:
        for array in (self.lo, self.hi, self.nbytes, self.src, self.dst_ptr, self.dsts):
            array.flags.writeable = False

    def __len__(self) -> int:
        return len(self.src)

    @property
    def fanout(self) -> np.ndarray:
        return np.diff(self.dst_ptr)


@dataclass(frozen=True)
class TransferSet:
    blocks: tuple[TransferBlock, ...] = ()

    def transfers(self) -> list[Transfer]:
        blocks = [b for b in self.blocks if len(b)]
        if not blocks:
            return []
        made: list[Transfer] = []
        for b in blocks:
            ptr = b.dst_ptr.tolist()
            dsts = b.dsts.tolist()
            rects = boxes.to_rects(b.lo, b.hi)
            for i, (rect, src, nbytes) in enumerate(zip(rects, b.src.tolist(), b.nbytes.tolist())):
                made.append(
                    _transfer(
                        b.tensor, rect, src, tuple(dsts[ptr[i] : ptr[i + 1]]), nbytes, b.reduce
                    )
                )
        return [made[i] for i in _order(blocks).tolist()]

    def order(self) -> np.ndarray:
        """The transfers of the non-empty blocks, concatenated in `blocks`' order, as
        `transfers` lists them: the index of each of its transfers among them."""
        blocks = [b for b in self.blocks if len(b)]
        return _order(blocks) if blocks else np.zeros(0, np.int64)

    @classmethod
    def from_transfers(cls, transfers: Iterable[Transfer]) -> TransferSet:
        """Blocks holding `transfers`, in their order (for plans assembled by hand)."""
        grouped: dict[tuple[str, bool], list[tuple[int, Transfer]]] = {}
        for position, t in enumerate(transfers):
            grouped.setdefault((t.tensor, t.reduce), []).append((position, t))
        blocks = []
        for (tensor, reduce), items in grouped.items():
            ndim = items[0][1].rect.ndim
            lo, hi = boxes.from_rects([t.rect for _, t in items], ndim)
            fanout = np.array([len(t.dsts) for _, t in items], boxes.INDEX)
            ptr = np.zeros(len(items) + 1, boxes.INDEX)
            np.cumsum(fanout, out=ptr[1:])
            blocks.append(
                TransferBlock(
                    tensor,
                    reduce,
                    lo,
                    hi,
                    np.array([t.nbytes for _, t in items], boxes.INDEX),
                    np.array([t.src for _, t in items], boxes.INDEX),
                    ptr,
                    np.array([d for _, t in items for d in t.dsts], boxes.INDEX),
                    np.array([p for p, _ in items], boxes.INDEX),
                    np.zeros(len(items), boxes.INDEX),
                )
            )
        return cls(tuple(blocks))


def _order(blocks: Sequence[TransferBlock]) -> np.ndarray:
    """The transfers of `blocks` (concatenated) in the task's order."""
    major = np.concatenate([b.major for b in blocks])
    minor = np.concatenate([b.minor for b in blocks])
    return np.lexsort((minor, major))


def _transfer(
    tensor: str, rect: Rect, src: int, dsts: tuple[int, ...], nbytes: int, reduce: bool
) -> Transfer:
    """A Transfer without the frozen dataclass's per-field `object.__setattr__` (this runs once
    per message when a plan of many ranks is read as objects)."""
    made = object.__new__(Transfer)
    made.__dict__.update(tensor=tensor, rect=rect, src=src, dsts=dsts, nbytes=nbytes, reduce=reduce)
    return made


def link_loads(
    blocks: Iterable[TransferBlock], nranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes sent, bytes received, message rounds) of each rank over `blocks`.

    A transfer to k destinations is a broadcast tree of ⌈log2(k+1)⌉ rounds, paid by its source
    and by each destination (see `cost.py`)."""
    sent = np.zeros(nranks)
    received = np.zeros(nranks)
    rounds = np.zeros(nranks)
    for b in blocks:
        if not len(b):
            continue
        fanout = b.fanout
        nbytes = b.nbytes.astype(float)
        tree = np.ceil(np.log2(fanout + 1.0))
        sent += np.bincount(b.src, weights=nbytes, minlength=nranks)
        rounds += np.bincount(b.src, weights=tree, minlength=nranks)
        received += np.bincount(b.dsts, weights=np.repeat(nbytes, fanout), minlength=nranks)
        rounds += np.bincount(b.dsts, weights=np.repeat(tree, fanout), minlength=nranks)
    return sent, received, rounds
