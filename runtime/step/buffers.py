"""A rank's buffers for one step: what lives when, and where in one arena it lives.

Resident tensors (data, parameters, optimizer state) keep their home cells for the whole run. Every
other buffer of a step lives only from the first task that uses it to the last, on this rank, in
its program (`runtime.step.rank_program`):

- a step tensor (an activation, a gradient, a statistic) over its box, from its first touch to its
  last, or to the completion of the last collective that sums into it; the statistics the training
  loop reads after the step (the loss, evaluate's sums) to the step's end;
- a copy's receive buffer from the point both sides post it to its consumer, and its send buffer
  from that point to the end of the first task after the consumer that computes on the sending
  rank (the step waits for the send there, `RankProgram.send_released`);
- a window of a sharded parameter (`RankTask.windows`), for its reading task, and from the point
  the copies it receives straight into are posted; a part of a sharded home that is one
  contiguous block moves with no send or receive buffer (`direct`);
- a partial sum's receive buffer within its task, and its send buffer from its task to where the
  step waits for it (`RankProgram.send_released`);
- a reduction's scratch within its task, or until its collective completes when the collective
  reduces it in place; a collective's flat vector and the buffers its adding hops receive into,
  from its task until it completes (`RankProgram.completions`).

The buffers are placed once per program in one arena, greedily by size (largest first, each at the
lowest offset clear of every placed buffer whose lifetime overlaps its own), as XLA's and TFLite's
arena planners do. Every step reuses the same offsets, so the arena's pages fault once, the memory
freed at a buffer's last use serves the next, and the runtime's bytes are known before it runs: the
prediction (`memory`) and the executor use this one placement. Large buffers start at
successive cache-line colours within a page, for the reason `runtime.aligned` gives.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from itertools import chain, compress

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from runtime.aligned import LINE, PAGE, aligned_empty
from runtime.instances import StorageOrder, choose_storage_orders
from runtime.step.rank_messages import Message, tensor_of
from runtime.step.rank_program import Collective, RankProgram, RankTask

#: buffers from this size start at a colour of their page (`runtime.aligned`)
COLOURED = 64 * 1024
_COLOUR_STEP = 17

#: what a buffer holds, for the breakdown of a rank's memory (`PARAMETERS`: the windows of
#: sharded parameters, fetched for one task)
ACTIVATIONS, GRADIENTS, MESSAGES, SCRATCH = "activations", "gradients", "messages", "scratch"
PARAMETERS = "fetched parameters"


@dataclass(frozen=True)
class Slot:
    key: Hashable
    nbytes: int
    #: the positions of the program's first and last tasks that use it (inclusive)
    first: int
    last: int
    what: str


@dataclass(frozen=True)
class Staging:
    """Where one rank's reductions and copies go, decided once per program, which the slots and
    the step both read: per task position, the scratch rect of each tensor its pieces reduce
    into (`scratch_rects`) and the target of each they reduce into in place (`in_place`); the
    copies that move with no staging buffer (`direct`) and the collectives that sum their
    scratch as it lies (`scratch_is_vector`), by sequence number."""

    scratch: dict[int, dict[str, Rect]] = field(default_factory=dict)
    in_place: dict[int, dict[str, Rect]] = field(default_factory=dict)
    direct: frozenset[int] = frozenset()
    vector_in_scratch: frozenset[int] = frozenset()


def staging(graph: TaskGraph, program: RankProgram, layouts: Mapping[str, StorageOrder]) -> Staging:
    scratch = {rt.index: scratch_rects(rt, program.boxes, layouts) for rt in program.tasks}
    placed: dict[int, dict[str, Rect]] = {}
    for rt in program.tasks:
        for tensor in rt.in_place:
            if in_place(rt, tensor, program.boxes, layouts):
                (target, _), *_ = (
                    c.targets[0] for c in rt.collectives if c.reduction.tensor == tensor
                )
                placed.setdefault(rt.index, {})[tensor] = target
    # only a resident tensor's copy may move with no staging buffer (`direct`)
    resident = {name for name, tensor in graph.tensors.items() if tensor.resident}
    posted = list(chain(program.post_at_start, *(rt.post for rt in program.tasks)))
    # in C: a model-parallel rank posts 10⁴ messages a task
    messages = list(compress(posted, map(resident.__contains__, map(tensor_of, posted))))
    summed = set()
    for index, collective in program.collectives:
        mine = scratch[index].get(collective.reduction.tensor)
        layout = layouts[collective.reduction.tensor]
        if mine is not None and scratch_is_vector(collective, mine, layout):
            summed.add(collective.seq)
    return Staging(
        scratch,
        placed,
        frozenset(m.seq for m in messages if direct(graph, program, m, layouts)),
        frozenset(summed),
    )


@dataclass
class StepBuffers:
    """The placed buffers of one rank program."""

    slots: dict[Hashable, Slot]
    #: slot key -> byte offset of its start in the arena
    offsets: dict[Hashable, int]
    #: bytes of the arena this program needs
    size: int
    #: tasks in the program
    length: int
    staging: Staging = field(default_factory=Staging)

    def live(self) -> np.ndarray:
        """Bytes of this program's buffers in use at each task."""
        delta = np.zeros(self.length + 1, np.int64)
        for slot in self.slots.values():
            delta[slot.first] += slot.nbytes
            delta[slot.last + 1] -= slot.nbytes
        return np.cumsum(delta[:-1])

    @cached_property
    def peak(self) -> int:
        """The most bytes in use at once: a lower bound on `size`."""
        return int(self.live().max(initial=0))

    def by_kind(self, position: int) -> dict[str, int]:
        """Bytes in use at task `position`, by what they hold."""
        out: dict[str, int] = {}
        for slot in self.slots.values():
            if slot.first <= position <= slot.last:
                out[slot.what] = out.get(slot.what, 0) + slot.nbytes
        return out


def step_slots(
    graph: TaskGraph,
    program: RankProgram,
    staged: Staging,
    keep: bool = False,
    read_after: Collection[str] = (),
) -> list[Slot]:
    """Every buffer of `program` that is not a resident tensor's, with its lifetime, as
    `staged` stages its reductions and copies; with `keep`, the step tensors live all step, so
    that all of them can be read after it; the tensors named in `read_after` (a prediction's
    outputs) live to the step's end, as the statistics do."""
    tensors = graph.tensors
    end = len(program.tasks) - 1
    touched: dict[str, list[int]] = {}
    for rt in program.tasks:
        for name in rt.tensors:
            touched.setdefault(name, []).append(rt.index)
    completion = program.completions
    summed_until: dict[str, int] = {}
    for (_, collective), done in zip(program.collectives, completion):
        tensor = collective.reduction.tensor
        summed_until[tensor] = max(summed_until.get(tensor, -1), done)

    slots: list[Slot] = []
    for name, box in program.boxes.items():
        tensor = tensors[name]
        if tensor.resident or name not in touched:
            continue
        first, last = touched[name][0], max(touched[name][-1], summed_until.get(name, -1))
        if tensor.kind == "stat" or keep or name in read_after:  # read after the step
            first, last = (0 if keep else first), end
        what = GRADIENTS if tensor.kind == "grad" else ACTIVATIONS
        slots.append(Slot(("tensor", name), box.volume * tensor.itemsize, first, last, what))

    windows: dict[tuple[int, str], int] = {}
    for rt in program.tasks:
        for name in rt.windows:
            windows[rt.index, name] = rt.index
    posted = [(0, m) for m in program.post_at_start]
    posted += [(rt.index, m) for rt in program.tasks for m in rt.post]
    for start, m in posted:
        if m.seq in staged.direct:
            if m.dst == program.rank:  # received into its reader's window: open from here
                windows[m.task, m.tensor] = min(windows[m.task, m.tensor], start)
            continue
        if m.src == program.rank:
            slots.append(Slot(("send", m.seq), m.nbytes, start, program.send_released(m), MESSAGES))
        else:
            slots.append(Slot(("recv", m.seq), m.nbytes, start, m.task, MESSAGES))
    for (index, name), first in windows.items():
        nbytes = program.tasks[index].windows[name].volume * tensors[name].itemsize
        slots.append(Slot(("window", index, name), nbytes, first, index, PARAMETERS))
    rects = staged.scratch
    scratch: dict[tuple[int, str], Slot] = {}
    for rt in program.tasks:
        for m in rt.partial_in:
            slots.append(Slot(("recv", m.seq), m.nbytes, rt.index, rt.index, MESSAGES))
        for m in rt.partial_out:
            released = program.send_released(m)
            slots.append(Slot(("send", m.seq), m.nbytes, rt.index, released, MESSAGES))
        for name, rect in rects[rt.index].items():
            nbytes = rect.volume * tensors[name].itemsize
            key = ("scratch", rt.index, name)
            scratch[rt.index, name] = Slot(key, nbytes, rt.index, rt.index, SCRATCH)
    for ordinal, (index, collective) in enumerate(program.collectives):
        done = completion[ordinal]
        itemsize = collective.reduction.itemsize
        tensor = collective.reduction.tensor
        if tensor not in staged.in_place.get(index, {}):
            if collective.seq in staged.vector_in_scratch:
                kept = scratch[index, tensor]
                scratch[index, tensor] = Slot(kept.key, kept.nbytes, index, done, SCRATCH)
            else:
                size = sum(rect.volume for rect, _ in collective.targets) * itemsize
                slots.append(Slot(("vector", collective.seq), size, index, done, SCRATCH))
        for k, size in enumerate(_hop_sizes(collective, program.rank)):
            slots.append(Slot(("hop", collective.seq, k), size * itemsize, index, done, MESSAGES))
    return slots + list(scratch.values())


def _hop_sizes(collective: Collective, rank: int) -> tuple[int, ...]:
    """Elements of each buffer `rank`'s adding hops of `collective` receive into."""
    segment = hop_segment(collective.reduction.itemsize)
    return tuple(min(size, segment) for size in collective.rounds.adding_sizes.get(rank, ()))


def hop_buffers(collectives: Iterable[Collective], rank: int) -> tuple[tuple[int, ...], ...]:
    """Per collective `rank` joins (`shared_programs.collectives_of`), the elements of each buffer
    its adding hops receive into, as `step_slots` places them: ranks that run one program (a
    class of `runtime.step.rank_classes`) hold the same buffers where these agree."""
    return tuple(_hop_sizes(collective, rank) for collective in collectives)


def direct(graph: TaskGraph, program: RankProgram, m: Message, layouts) -> bool:
    """Whether copy `m` of a resident tensor (a sharded home's part) moves with no staging
    buffer on this rank: sent from the home, or received into its reader's window, where its
    rect is one contiguous block of that array (a shard cut along its outermost axis is)."""
    if m.reduce or not graph.tensors[m.tensor].resident:
        return False
    if m.src == program.rank:
        box = program.boxes[m.tensor]
    else:
        box = program.tasks[m.task].windows[m.tensor]
    layout = layouts[m.tensor]
    return contiguous(layout.shape(m.rect.shape), layout.shape(box.shape))


def in_place(rt: RankTask, tensor: str, boxes: Mapping[str, Rect], layouts) -> bool:
    """Whether `rt`'s pieces reduce `tensor` straight into this rank's buffer of it
    (`RankTask.in_place`): a collective needs its target as one flat vector, so only where the
    target is a contiguous block of the buffer."""
    if tensor not in rt.in_place:
        return False
    (target, _), *_ = (c.targets[0] for c in rt.collectives if c.reduction.tensor == tensor)
    return contiguous(
        layouts[tensor].shape(target.shape), layouts[tensor].shape(boxes[tensor].shape)
    )


def contiguous(block: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    """Whether a block of shape `block` in a C-ordered array of shape `whole` is contiguous: every
    axis after its first longer than one spans the whole array."""
    axes = [i for i, n in enumerate(block) if n > 1]
    return not axes or all(block[i] == whole[i] for i in range(axes[0] + 1, len(block)))


def scratch_rects(rt: RankTask, boxes: Mapping[str, Rect], layouts) -> dict[str, Rect]:
    """Per tensor, the rect of the scratch this rank's pieces of `rt` reduce into: a reduction
    that is not wholly this rank's (it has local parts or a collective), and not in place."""
    out = {}
    summed = {c.reduction.tensor for c in rt.collectives}
    for piece in rt.pieces:
        for req in piece.requirements:
            if req.privilege is not Privilege.REDUCE or in_place(rt, req.tensor, boxes, layouts):
                continue
            if req.tensor in rt.local_parts or req.tensor in summed:
                if req.tensor in out:
                    raise AssertionError(f"{rt.task.name}: two pieces reduce {req.tensor} here")
                out[req.tensor] = req.write_rect
    return out


def scratch_is_vector(collective: Collective, rect: Rect, layout: StorageOrder) -> bool:
    """Whether this rank's contribution (its scratch over `rect`) is the collective's flat
    vector as it lies: the targets, in the vector's order, are consecutive contiguous blocks of
    it that cover it (a replicated gradient's one target; a sharded one's shards, cut along its
    outermost axis)."""
    whole = layout.shape(rect.shape)
    offset = 0
    for target, _ in collective.targets:
        if not rect.contains(target) or not contiguous(layout.shape(target.shape), whole):
            return False
        start = layout.shape(target.relative_to(rect).lo)
        if target.volume and int(np.ravel_multi_index(start, whole)) != offset:
            return False
        offset += target.volume
    return offset == rect.volume


#: the most bytes an adding hop of a collective receives at once (`running_collective.Adding`),
#: unless `LEGION_NN_HOP_SEGMENT_BYTES` says (the tests make hops of many segments with it)
HOP_SEGMENT_BYTES = 8 * 2**20


def hop_segment(itemsize: int) -> int:
    """Elements of an adding hop received at once."""
    text = os.environ.get("LEGION_NN_HOP_SEGMENT_BYTES", "")
    nbytes = int(text) if text.isdigit() and int(text) > 0 else HOP_SEGMENT_BYTES
    return max(nbytes // itemsize, 1)


def _reserved(nbytes: int) -> int:
    size = -(-nbytes // LINE) * LINE
    return size + PAGE if nbytes >= COLOURED else size


def place(slots: list[Slot], length: int, compiled_from: int | None = None) -> StepBuffers:
    """Offsets for `slots` in one arena: largest first, each at the lowest offset clear of the
    placed slots whose lifetimes overlap its own (by the compiled scan from `compiled_from`
    slots, by default `COMPILED_FROM`)."""
    order = sorted(slots, key=lambda s: (-s.nbytes, s.first, s.key))
    starts, size = _placement(tuple((s.nbytes, s.first, s.last) for s in order), compiled_from)
    offsets = {slot.key: start for slot, start in zip(order, starts)}
    return StepBuffers({s.key: s for s in slots}, offsets, size, length)


#: from this many slots on, `_placement` runs its compiled scan (`compiled_placement`):
#: DenseNet-121's program of 33,167 buffers is placed in 0.8 s. A run with fewer (the default
#: job's few hundred) never compiles it, so a cold start does not wait for it
COMPILED_FROM = 2000
#: from this many slots on, the memory model's placements (`memory.predict`) run the compiled
#: scan: a prediction places many ranks' programs, each of a thousand slots or more on 64 ranks
#: of resnet18 with grids mixed per layer (0.5 s of its 1.4 s), where a run places its one
PREDICTED_COMPILED_FROM = 500


@lru_cache(maxsize=64)
def _placement(
    order: tuple[tuple[int, int, int], ...], compiled_from: int | None = None
) -> tuple[list[int], int]:
    """Each slot's start and the arena's size, for slots (bytes, first, last) in placing
    order: a function of these alone, so ranks whose programs have the same buffers (a
    data-parallel plan's) place them once.

    A slot goes at the lowest offset, past the placed slots whose lifetimes overlap its own
    (in order of offset), that leaves room before the next of them; a slot of `COLOURED` bytes
    or more at a page boundary. Offered at the i-th such slot is the end of those before it, at
    least 0, rounded up to a page where the slot is coloured (rounding at each step or once at
    the end gives the same)."""
    n = len(order)
    table = np.asarray(order, np.int64).reshape(n, 3)
    if n >= (COMPILED_FROM if compiled_from is None else compiled_from):
        from runtime.step.compiled_placement import first_fit

        starts, size = first_fit(table, LINE, PAGE, COLOURED, _COLOUR_STEP)
        return starts.tolist(), int(size)
    firsts, lasts = table[:, 1], table[:, 2]
    offsets = np.zeros(n, np.int64)
    ends = np.zeros(n, np.int64)
    starts: list[int] = []
    size = 0
    colour = 0
    for k, (nbytes, first, last) in enumerate(order):
        need = _reserved(nbytes)
        overlap = (firsts[:k] <= last) & (lasts[:k] >= first)
        lo, hi = offsets[:k][overlap], ends[:k][overlap]
        by_offset = np.lexsort((hi, lo))
        lo, hi = lo[by_offset], hi[by_offset]
        offered = np.maximum.accumulate(np.concatenate(([0], hi)))
        coloured = nbytes >= COLOURED
        if coloured:
            offered = -(-offered // PAGE) * PAGE
        room = np.flatnonzero(offered[:-1] + need <= lo)
        offset = int(offered[room[0]] if len(room) else offered[-1])
        if coloured:
            need_start = offset + colour * _COLOUR_STEP * LINE % PAGE
            colour += 1
        else:
            need_start = offset
        offsets[k], ends[k] = offset, offset + need
        starts.append(need_start)
        size = max(size, offset + need)
    return starts, size


def step_buffers(
    graph: TaskGraph,
    program: RankProgram,
    layouts: Mapping[str, StorageOrder] | None = None,
    keep: bool = False,
    read_after: Collection[str] = (),
    compiled_from: int | None = None,
) -> StepBuffers:
    """The placed buffers of `program` on its rank (`keep`, `read_after`: see `step_slots`;
    `compiled_from`: see `place`)."""
    staged = staging(graph, program, layouts or choose_storage_orders(graph))
    slots = step_slots(graph, program, staged, keep, read_after)
    placed = place(slots, len(program.tasks), compiled_from)
    return replace(placed, staging=staged)


class Arena:
    """The memory a rank's step buffers live in: grown to the largest program it has served, and
    kept, so that its pages are faulted once."""

    def __init__(self) -> None:
        self._bytes = np.empty(0, np.uint8)
        #: grows by one each time the memory is replaced: views made before are stale
        self.generation = 0

    def reserve(self, size: int) -> None:
        if size > self._bytes.size:
            self._bytes = aligned_empty((size,), np.uint8)
            self.generation += 1

    @property
    def nbytes(self) -> int:
        return int(self._bytes.size)

    def view(self, buffers: StepBuffers, key: Hashable, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        offset = buffers.offsets[key]
        nbytes = count * dtype.itemsize
        if nbytes > buffers.slots[key].nbytes:
            raise AssertionError(f"buffer {key} of {nbytes} bytes exceeds its slot")
        return self._bytes[offset : offset + nbytes].view(dtype).reshape(shape)
