"""What every rank's builder (`rank_builder.Builder`) is told of each task of a step, found once
for all ranks (`task_events`), and the builders told it (`build_each`): the messages of a step
numbered alike on every rank, each posted after the task that last wrote its rect (the plan's
record, `Plan.written_by`), and the collectives with their schedules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from partitioner import boxes
from partitioner.collectives import schedule, target_order
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.pieces import Piece, PieceSet
from partitioner.plan import Plan
from partitioner.task_plan import Reduction
from partitioner.transfers import TransferSet
from runtime.step.last_writes import LastWrites
from runtime.step.order import step_order
from runtime.step.rank_builder import Builder
from runtime.step.rank_messages import STEP_START, Message, MessagesTold
from runtime.step.rank_parts import has_part
from runtime.step.rank_program import Collective, RankProgram


@dataclass
class TaskEvents:
    """What every rank's builder is told of one task of the step: the same for each rank, found
    once (`task_events`), so that ranks whose programs are alike share one build
    (`runtime.step.programs`)."""

    position: int
    task: Task
    holdings: Mapping[str, Layout]
    deferred: Mapping[str, int]
    #: per rank, its pieces of the task (`PiecesByRank`: made when first asked for)
    mine: PiecesByRank
    #: the task's messages with an end among the ranks built, in sequence order
    messages: list[Message]
    #: per rank built with an end of one of them, its ends grouped as its builder files them
    told: ToldEnds
    #: their sequence numbers, sources, destinations and bytes, a row each, in order
    facts: np.ndarray
    #: the task's collectives, each with the bytes each participant's hops send and the
    #: position of the task it starts after: this one's, or, for an all-gather bringing its
    #: reads, the last writer's (`partitioner.gathers`)
    collectives: list[tuple[Collective, dict[int, int], int]]
    #: the sequence number after the task's messages and hops: the step's message count, after
    #: its last task
    next_seq: int


def task_events(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    ranks: Iterable[int],
    include: Iterable[str] | None = None,
) -> tuple[list[TaskEvents], int]:
    """Per task of the step (in `step_order`, those named in `include`), what `build_programs`
    tells the builders of `ranks`; and the number of messages of the step."""
    events = list(each_task_event(graph, plan, machine, ranks, include))
    return events, step_messages(events)


def step_messages(events: Sequence[TaskEvents]) -> int:
    """The number of messages (and collective hops) of the step whose `events` these are."""
    return events[-1].next_seq if events else 0


def each_task_event(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    ranks: Iterable[int],
    include: Iterable[str] | None = None,
) -> Iterator[TaskEvents]:
    """`task_events`' events one task at a time, each made when asked for: a reader that stops
    early (`rank_classes`, where the ranks fall into too many classes) makes no more."""
    wanted = set(include) if include is not None else None
    built = set(ranks)
    indexed = [
        (i, graph.tasks[i], plan.tasks[i])
        for i in step_order(graph)
        if wanted is None or graph.tasks[i].name in wanted
    ]
    last_writes = LastWrites(len(graph.tasks), (index for index, _, _ in indexed))
    sharded_grads = {
        name
        for name, tensor in graph.tensors.items()
        if tensor.kind == "grad" and name.removesuffix(".grad") in plan.sharded
    }
    in_built = np.zeros(plan.nranks, bool)
    in_built[list(built)] = True
    seq = 0
    for position, (index, task, task_plan) in enumerate(indexed):
        mine = PiecesByRank(task_plan.piece_sets, built)
        # a gather starts where its copies would be posted, after the tensor's writer; where
        # the writer is out of view (a program of some tasks), its copies come at the start
        gathers, copied = [], []
        for block, gather in task_plan.gathered:
            start = int(last_writes.positions(gather.tensor, block.lo, block.hi).max())
            if start == STEP_START:
                copied.append(block)
            else:
                gathers.append((gather, start))
        transfer_set = task_plan.transfer_set
        if copied:
            transfer_set = TransferSet((*transfer_set.blocks, *copied))
        messages, told, facts, seq = _told_messages(
            transfer_set, in_built, position, last_writes, graph, seq
        )
        collectives = []
        for gather, start in gathers:
            collective, seq = _collective(gather, machine, seq, False, start)
            collectives.append(collective)
        for reduction in task_plan.reductions:
            collective, seq = _collective(
                reduction, machine, seq, reduction.tensor in sharded_grads, position
            )
            collectives.append(collective)
        for tensor, layout in task_plan.holdings.items():
            last_writes.record(tensor, layout, plan.written_by[index][tensor])
        yield TaskEvents(
            position,
            task,
            task_plan.holdings,
            task_plan.deferred,
            mine,
            messages,
            told,
            facts,
            collectives,
            seq,
        )


def _collective(
    reduction: Reduction, machine: Machine, seq: int, sharded: bool, start: int
) -> tuple[tuple[Collective, dict[int, int], int], int]:
    """(the collective of `reduction` whose hops are numbered from `seq`, the bytes each
    participant's hops send, and the position of the task it starts after), and the sequence
    number after its hops."""
    order = target_order(reduction, machine)
    rounds = schedule(reduction, machine)
    collective = Collective(
        reduction,
        tuple(reduction.targets[t] for t in order),
        rounds,
        seq,
        sharded,
        tuple(reduction.owners[t] for t in order) if reduction.owners else (),
    )
    return (collective, rounds.sent(reduction.itemsize), start), seq + rounds.hops


def _told_messages(
    transfer_set: TransferSet,
    in_built: np.ndarray,
    position: int,
    last_writes: LastWrites,
    graph: TaskGraph,
    seq: int,
) -> tuple[list[Message], ToldEnds, np.ndarray, int]:
    """The messages of the task at `position` with an end among the ranks built (`in_built`,
    per rank), in sequence order, their ends grouped per rank built (`ToldEnds`), their facts
    (`TaskEvents.facts`), and the sequence number after all its messages: one per destination
    of each transfer, numbered in the task's order of transfers (`TransferSet.transfers`) alike
    on every rank, built or not.
    Read off the blocks' arrays: a fan-out from another rank reaches most ranks elsewhere (a
    channel's slice sent to every rank of a model-parallel layer), and no message or transfer
    object is made for those. A copy is posted after the task that last wrote some part of its
    rect (`LastWrites.positions`), a partial sum after its own task, a resident tensor's part
    (a sharded home's, fetched just before its reader and dropped after it) after the task
    before."""
    blocks = [b for b in transfer_set.blocks if len(b)]
    if not blocks:
        return [], _NO_ENDS, _NO_FACTS, seq
    fanouts = [b.fanout for b in blocks]
    fanout = np.concatenate(fanouts)
    order = transfer_set.order()
    # each transfer's first sequence number, numbered in the task's order
    first = np.empty_like(fanout)
    first[order] = seq + np.cumsum(fanout[order]) - fanout[order]
    offsets = np.cumsum([0] + [len(b) for b in blocks[:-1]]).tolist()
    #: per block with an end among the ranks built, its messages' seqs, ends, bytes, post
    #: points and whether each is a partial sum
    columns_of: list[tuple[np.ndarray, ...]] = []
    told: list[Message] = []
    received: list[tuple[str, bool, np.ndarray, np.ndarray, np.ndarray]] = []
    for block, count, offset in zip(blocks, fanouts, offsets):
        transfer = np.repeat(np.arange(len(block)), count)
        keep = in_built[block.src[transfer]] | in_built[block.dsts]
        if not keep.any():
            continue
        pair = np.flatnonzero(keep)
        transfer = transfer[pair]
        seqs = first[offset + transfer] + pair - block.dst_ptr[transfer]
        kept, which = np.unique(transfer, return_inverse=True)
        which = which.reshape(-1)
        rects = np.empty(len(kept), object)
        rects[:] = boxes.to_rects(block.lo[kept], block.hi[kept])
        if block.reduce:
            posts = np.full(len(pair), position, np.int64)
        elif graph.tensors[block.tensor].resident:
            posts = np.full(len(pair), max(position - 1, STEP_START), np.int64)
        else:
            posts = last_writes.positions(block.tensor, block.lo[kept], block.hi[kept])[which]
        src, dst, nbytes = block.src[transfer], block.dsts[pair], block.nbytes[transfer]
        columns = (
            seqs.tolist(),
            repeat(block.tensor),
            rects[which].tolist(),
            src.tolist(),
            dst.tolist(),
            nbytes.tolist(),
            repeat(position),
            posts.tolist(),
            repeat(block.reduce),
        )
        told += map(_message, zip(*columns))  # no Python frame a message: some 10⁷ a plan
        reduce = np.full(len(pair), block.reduce)
        columns_of.append((seqs, src, dst, nbytes, posts, reduce))
        into = in_built[dst]
        if into.any():
            received.append(
                (block.tensor, block.reduce, dst[into], block.lo[transfer[into]],
                 block.hi[transfer[into]])
            )  # fmt: skip
    if not columns_of:
        return [], _NO_ENDS, _NO_FACTS, seq + int(fanout.sum())
    seqs, src, dst, nbytes, posts, reduce = map(np.concatenate, zip(*columns_of))
    if (seqs[1:] < seqs[:-1]).any():  # blocks' transfers interleave in the task's order
        in_order = np.argsort(seqs)
        told = [told[i] for i in in_order.tolist()]
        seqs, src, dst, nbytes, posts, reduce = (
            a[in_order] for a in (seqs, src, dst, nbytes, posts, reduce)
        )
    ends = ToldEnds((told, src, dst, nbytes, posts, reduce, received))
    facts = np.column_stack((seqs, src, dst, nbytes)).astype(np.int64, copy=False)
    return told, ends, facts, seq + int(fanout.sum())


class ToldEnds:
    """Each built rank's ends of a task's messages, grouped as its builder files them
    (`rank_messages.MessagesTold`), found from the messages' arrays for the ranks asked about
    at once (`of_ranks`): a model-parallel rank is told 10⁴ messages a task, and where ranks
    alike are built once, the others' ends are never grouped."""

    def __init__(self, arrays: tuple = ()) -> None:
        #: `_grouped`'s arguments but the ranks; none where no rank built has an end
        self._arrays = arrays

    def of_ranks(self, wanted: np.ndarray) -> dict[int, MessagesTold]:
        """Per rank with an end of one of the messages, among those `wanted` (per rank), its
        ends grouped."""
        return _grouped(*self._arrays, wanted) if self._arrays else {}


_NO_ENDS = ToldEnds()
_NO_FACTS = np.zeros((0, 4), np.int64)

#: what a rank's builder files each of its ends of a message under (`_grouped`)
_PARTIAL_OUT, _PARTIAL_IN, _COPY_IN, _POSTED = range(4)


def _grouped(
    told: list[Message],
    src: np.ndarray,
    dst: np.ndarray,
    nbytes: np.ndarray,
    posts: np.ndarray,
    reduce: np.ndarray,
    received: list[tuple[str, bool, np.ndarray, np.ndarray, np.ndarray]],
    wanted: np.ndarray,
) -> dict[int, MessagesTold]:
    """`ToldEnds.of_ranks`: each wanted end's (rank, group, post point, message) sorted, and
    each run of one rank's group (and post point) taken from the messages in that order at
    once."""
    index = np.arange(len(told))
    sends, gets = wanted[src], wanted[dst]
    copies = ~reduce
    chosen = (
        (src, sends & reduce, _PARTIAL_OUT),
        (dst, gets & reduce, _PARTIAL_IN),
        (dst, gets & copies, _COPY_IN),
        (src, sends & copies, _POSTED),  # both ends post a copy
        (dst, gets & copies, _POSTED),
    )
    rank = np.concatenate([ends[picked] for ends, picked, _ in chosen])
    group = np.concatenate([np.full(int(picked.sum()), g) for _, picked, g in chosen])
    message = np.concatenate([index[picked] for _, picked, _ in chosen])
    post = np.where(group == _POSTED, posts[message], 0)
    order = np.lexsort((message, post, group, rank))
    rank, group, post, message = rank[order], group[order], post[order], message[order]
    starts = boxes.run_starts(
        (rank[1:] != rank[:-1]) | (group[1:] != group[:-1]) | (post[1:] != post[:-1])
    )
    stops = boxes.run_ends(starts, len(rank))
    ordered = list(map(told.__getitem__, message.tolist()))
    out: dict[int, MessagesTold] = {}
    runs = zip(rank[starts].tolist(), group[starts].tolist(), post[starts].tolist(),
               starts.tolist(), stops.tolist())  # fmt: skip
    for r, g, p, start, stop in runs:
        found = out.get(r)
        if found is None:
            found = out[r] = MessagesTold()
        run = ordered[start:stop]
        if g == _POSTED:
            found.posted.append((p, run))
        elif g == _COPY_IN:
            found.copies_in = run
        elif g == _PARTIAL_IN:
            found.partial_in = run
        else:
            found.partial_out = run
    sent = np.zeros(len(wanted), np.int64)
    np.add.at(sent, src[sends], nbytes[sends])
    for r, found in out.items():
        found.sent_bytes = int(sent[r])
    for tensor, reduces, ends, lo, hi in received:
        mine = wanted[ends]
        ranks, lo, hi = boxes.bounding_by_key(ends[mine], lo[mine], hi[mine])
        for r, box in zip(ranks.tolist(), boxes.to_rects(lo, hi)):
            out[r].received.append((tensor, box, reduces))
    return out


#: a `Message` of its fields in order, made without its named tuple's `__new__`
_message = partial(tuple.__new__, Message)


class PiecesByRank:
    """Each built rank's pieces of one task, in the plan's order: found for every rank at once
    from the piece sets' arrays when first asked for, and each piece made only when a rank that
    computes it is asked for. The ranks of a class of alike ranks are built once
    (`rank_classes`), so most ranks' pieces are never made."""

    def __init__(self, piece_sets: Sequence[PieceSet], built: set[int]) -> None:
        self.piece_sets = piece_sets
        self._built = built
        #: the (rank, set, piece) triples by rank, in the plan's order within a rank, and
        #: where each rank's begin (`_sorted`)
        self._index: tuple[np.ndarray, np.ndarray, dict[int, tuple[int, int]]] | None = None
        self._made: dict[tuple[int, int], Piece] = {}
        #: every built rank's pieces, where `make_every_rank` made them
        self._every: dict[int, list[Piece]] | None = None

    def _sorted(self) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, int]]]:
        """(set of each triple, piece of each, per rank the span of its triples): found once
        for every rank from the piece sets' arrays; each rank's pairs are made only where it
        is asked for (one rank per class of alike ranks)."""
        if self._index is None and len(self.piece_sets) == 1:
            self._index = _one_set_sorted(self.piece_sets[0])
        if self._index is None:
            sets, pieces, ranks = [], [], []
            for k, piece_set in enumerate(self.piece_sets):
                counts = np.diff(piece_set.rank_ptr)
                sets.append(np.full(len(piece_set.ranks), k, np.int64))
                pieces.append(np.repeat(np.arange(len(piece_set), dtype=np.int64), counts))
                ranks.append(piece_set.ranks.astype(np.int64))
            empty = np.zeros(0, np.int64)
            set_of, piece_of, rank_of = (
                (np.concatenate(a) for a in (sets, pieces, ranks)) if sets else (empty,) * 3
            )
            order = np.argsort(rank_of, kind="stable")  # the plan's order within a rank
            set_of, piece_of, rank_of = set_of[order], piece_of[order], rank_of[order]
            # a rank twice among a piece's ranks has the piece once
            new = np.ones(len(rank_of), bool)
            new[1:] = (
                (rank_of[1:] != rank_of[:-1])
                | (set_of[1:] != set_of[:-1])
                | (piece_of[1:] != piece_of[:-1])
            )
            set_of, piece_of, rank_of = set_of[new], piece_of[new], rank_of[new]
            starts = boxes.run_starts(rank_of[1:] != rank_of[:-1]) if len(rank_of) else empty
            ends = boxes.run_ends(starts, len(rank_of))
            spans = dict(zip(rank_of[starts].tolist(), zip(starts.tolist(), ends.tolist())))
            self._index = (set_of, piece_of, spans)
        return self._index

    def _piece(self, k: int, i: int) -> Piece:
        found = self._made.get((k, i))
        if found is None:
            found = self._made[(k, i)] = self.piece_sets[k].piece(i)
        return found

    def make_every_rank(self) -> None:
        """Make every built rank's pieces now, all at once: where every rank is built, making
        them piece by piece as asked for would cost more."""
        by_rank: dict[int, list[Piece]] = {}
        built = np.fromiter(self._built, np.int64, len(self._built))
        for piece_set in self.piece_sets:
            for piece in piece_set.pieces_of(built):
                for rank in dict.fromkeys(piece.ranks):
                    if rank in self._built:
                        by_rank.setdefault(rank, []).append(piece)
        self._every = by_rank

    def get(self, rank: int, default=()) -> list[Piece] | tuple:
        if self._every is not None:
            return self._every.get(rank, default)
        if rank not in self._built:
            return default
        set_of, piece_of, spans = self._sorted()
        span = spans.get(rank)
        if span is None:
            return default
        start, end = span
        return [
            self._piece(k, i)
            for k, i in zip(set_of[start:end].tolist(), piece_of[start:end].tolist())
        ]


def _one_set_sorted(
    piece_set: PieceSet,
) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, int]]] | None:
    """`PiecesByRank._sorted` of one piece set whose pieces each have one rank, in ascending
    order (a split over the batch): each rank's span its piece; None for any other set."""
    if len(piece_set) == 0 or not (np.diff(piece_set.rank_ptr) == 1).all():
        return None
    ranks = piece_set.ranks.astype(np.int64)
    if not (ranks[1:] > ranks[:-1]).all():
        return None
    n = len(ranks)
    spans = dict(zip(ranks.tolist(), zip(range(n), range(1, n + 1))))
    return np.zeros(n, np.int64), np.arange(n, dtype=np.int64), spans


def build_each(
    graph: TaskGraph, plan: Plan, events: list[TaskEvents], messages: int, ranks: list[int]
) -> dict[int, RankProgram]:
    """The programs of `ranks` (updates not fused), each built by telling it every task."""
    programs = {rank: Builder(graph, plan, rank) for rank in ranks}
    wanted = np.zeros(plan.nranks, bool)
    wanted[ranks] = True
    built = np.array(ranks, np.int64)
    index = {task.name: i for i, task in enumerate(graph.tasks)}
    parts = has_part(plan)
    for event in events:
        told = event.told.of_ranks(wanted) if event.messages else {}
        active = parts[index[event.task.name], built]
        busy = [programs[rank] for rank in built[active].tolist()]
        for builder in busy:
            builder.begin(event.position, event.task, event.mine.get(builder.rank, ()))
        for rank, ends in told.items():
            programs[rank].messages(ends)
        for collective, sent, start in event.collectives:
            for rank in collective.reduction.participants:
                if rank in programs:
                    programs[rank].collective(collective, sent.get(rank, 0), start)
        for builder in busy:
            builder.end(event.holdings, event.deferred)
        for rank in built[~active].tolist():
            programs[rank].idle(event.position, event.task, event.holdings)
    return {rank: builder.program(messages) for rank, builder in programs.items()}
