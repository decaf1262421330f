"""A lower bound on the classes of ranks alike (`rank_classes`), found from a plan's arrays at once.

`programs.build_programs` asks it before telling ranks apart: a plan whose ranks would fall into
more classes than it allows (a mixture of grids on 1024 ranks, whose every rank differs) is
known so in some 30 ms, where telling its ranks apart costs 35 ms a task until it gives up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partitioner.pieces import PieceSet
from partitioner.plan import Plan
from runtime.step.rank_classes import requirement_key, told_pieces, told_slots

#: the most tasks `fewest_classes` reads: the tasks of any subset give a bound, and 256 take some
#: 30 ms on 1024 ranks, where telling the ranks apart takes 35 ms a task
BOUND_TASKS_AT_MOST = 256
_ODD = np.uint64(0x9E3779B97F4A7C15)  # multiplying by an odd word permutes the words
_PRIME = np.uint64(1099511628211)


def fewest_classes(plan: Plan, ranks: Sequence[int], tasks: Sequence[int] | None = None) -> int:
    """At least as many classes as `rank_classes` finds for `ranks` over the tasks of `plan` at
    the indices `tasks` (default: every task), found from the plan's arrays at once, without
    the step's events, so that a plan whose ranks would fall into too many classes is known
    before they are told apart (35 ms a task on 1024 ranks).

    Ranks of one class are told rows that differ only in where their rects lie: the same
    requirements with rects of the same shapes (a shape is the difference of a row's relative
    corners), and the same messages, of the same bytes, at the same ends. So a function of
    each task's rows, the same for every rank told them, tells apart no ranks of one class:
    here, per task, the sum over a rank's pieces of a word of their requirements and shapes,
    plus the sum over its messages of a word of their bytes and its ends. Ranks with different
    words somewhere are in different classes; two words that collide only lower the bound.
    Past `BOUND_TASKS_AT_MOST` tasks, that many spread over the step are read."""
    ranks = list(ranks)
    if tasks is None:
        tasks = range(len(plan.tasks))
    tasks = list(tasks)
    if len(tasks) > BOUND_TASKS_AT_MOST:
        picked = np.linspace(0, len(tasks) - 1, BOUND_TASKS_AT_MOST).astype(np.int64)
        tasks = [tasks[i] for i in np.unique(picked).tolist()]
    slot_of = np.full(max(ranks, default=0) + 1, -1, np.int64)
    slot_of[ranks] = np.arange(len(ranks))
    n = len(ranks)
    words: dict[tuple, int] = {}
    signature = np.zeros(n, np.uint64)
    for index in tasks:
        task_plan = plan.tasks[index]
        told = np.zeros(n, np.uint64)
        for piece_set in task_plan.piece_sets:
            _add_words(told, *_piece_words(piece_set, slot_of, words))
        for block in task_plan.transfer_set.blocks:
            fanout = np.diff(block.dst_ptr)
            sources = block.src.astype(np.int64)
            destinations = block.dsts.astype(np.int64)
            to_self = np.repeat(sources, fanout) == destinations
            nbytes = np.repeat(block.nbytes.astype(np.uint64), fanout)
            # each message's row at each of its ends: its bytes, and whether that end is the
            # source and the destination
            ends = np.concatenate((np.repeat(sources, fanout), destinations))
            src_end = np.r_[np.ones(len(nbytes), bool), to_self]
            dst_end = np.r_[to_self, np.ones(len(nbytes), bool)]
            word = np.r_[nbytes, nbytes] * np.uint64(4) + src_end * np.uint64(2) + dst_end
            _add_words(told, told_slots(ends, slot_of), word * _ODD + np.uint64(1))
        signature = signature * _PRIME + told
    return len(np.unique(signature))


def _piece_words(
    piece_set: PieceSet, slot_of: np.ndarray, words: dict[tuple, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(the slot of each rank told a piece of `piece_set`, a word per such (piece, rank) of the
    set's requirements and their rects' shapes), as `rank_classes` tells them."""
    pieces, slots = told_pieces(piece_set, slot_of)
    key = requirement_key(piece_set)
    word = np.full(len(piece_set), words.setdefault(key, len(words)) + 1, np.uint64)
    for lo, hi in zip(piece_set.req_lo, piece_set.req_hi):
        for d in range(lo.shape[1]):
            word = word * np.uint64(1000003) + (hi[:, d] - lo[:, d]).astype(np.uint64)
    return slots, word[pieces] * _ODD


def _add_words(told: np.ndarray, slots: np.ndarray, words: np.ndarray) -> None:
    inside = slots >= 0
    np.add.at(told, slots[inside], words[inside])
