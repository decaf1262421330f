"""Pieces as arrays: the rect each rank computes of a task, and the rects its requirements touch.

A `PieceSet` is a run of pieces sharing one list of requirements: piece i is the box
(`lo[i]`, `hi[i]`), computed by `ranks[rank_ptr[i]:rank_ptr[i + 1]]`, and its requirement j
touches (`req_lo[j][i]`, `req_hi[j][i]`). It is frozen and its arrays are not writeable, so the
`Piece` objects made from it on demand, as executors and `verify_plan` read them, are read-only
views of what the cost model and the accounting read.

*Grid pieces* (a partitioned task): cell i of the row-major grid, on rank i; empty cells are
left out. Their requirement rects come from the layer's access map. One call per piece costs
several microseconds, a second for 1024 ranks, so a grid of more than `DIRECT_LIMIT` pieces
takes them from the op's array map (`box_map`), all pieces at once, where it has one and it
agrees with the access map on a sample of pieces (as below); otherwise the grid is *probed*:
the map is applied to the whole space and, for each cut dim d and each part i, to the space cut
only along d. The access maps here are axis-separable (each dim of a returned
rect follows at most one dim of the piece: a halo's rows its rows, a linear layer's weight rows
its features; cutting another dim never widens it), so a piece's rect is the intersection of
its probes' rects. This is checked, not assumed: a map where a dim of a rect moves with two dims
of the piece, or whose probed rects differ from direct calls on a sample of pieces (the grid's
corners, its centre, a few more), is applied piece by piece.

*Homed pieces* (data loading, updates, zeroing parameter gradients): one per cell of the tensor's
home, run by every holder of the cell; each requirement touches the cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from itertools import product
from operator import attrgetter, itemgetter
from weakref import WeakKeyDictionary, ref

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task
from legion_nn.micro_batches import PLACEMENT_ATTRS
from legion_nn.op_records import BoxMap, access_map, box_map
from legion_nn.rect import Rect
from partitioner import boxes, reduction_split
from partitioner.layout import Layout
from partitioner.plan_memo import PlanMemo
from partitioner.reduction_split import SumTarget

#: grids of at most this many pieces get one access-map call per piece
DIRECT_LIMIT = 16
#: pieces checked against direct calls, besides the grid's corners and centre
SAMPLE = 8

_lo_of, _hi_of = attrgetter("lo"), attrgetter("hi")


@dataclass(frozen=True)
class Piece:
    """A rect of a task's space, computed by `ranks` (one rank unless homed and replicated)."""

    ranks: tuple[int, ...]
    rect: Rect
    requirements: tuple[Requirement, ...]


@dataclass(frozen=True)
class PieceSet:
    lo: np.ndarray
    hi: np.ndarray
    rank_ptr: np.ndarray
    ranks: np.ndarray
    requirements: tuple[Requirement, ...]
    req_lo: list[np.ndarray]
    req_hi: list[np.ndarray]
    #: where the partial sums of a grid that cuts a reduction dim land (`reduction_split`)
    sums: tuple[SumTarget, ...] = ()

    def __post_init__(self) -> None:
        targets = [a for _, *arrays in self.sums for a in arrays]
        for array in (
            self.lo,
            self.hi,
            self.rank_ptr,
            self.ranks,
            *self.req_lo,
            *self.req_hi,
            *targets,
        ):
            array.flags.writeable = False

    def __len__(self) -> int:
        return len(self.lo)

    @property
    def owners(self) -> np.ndarray:
        """The first rank of each piece (its only one for grid pieces)."""
        return self.ranks[self.rank_ptr[:-1]]

    def volumes(self) -> np.ndarray:
        return boxes.volumes(self.lo, self.hi)

    def placed_from(self, first: int) -> PieceSet:
        """These pieces, and their sums' targets, on ranks counted from `first` (a pipeline
        stage's ranks) rather than from 0."""
        if not first:
            return self
        return replace(
            self,
            ranks=self.ranks + first,
            sums=tuple((j, ranks + first, lo, hi) for j, ranks, lo, hi in self.sums),
        )

    def piece(self, i: int) -> Piece:
        """Piece i alone, as `pieces` makes every one."""
        rect = boxes.to_rect(self.lo[i].tolist(), self.hi[i].tolist())
        requirements = tuple(
            _with_rect(
                req, rect if lo is self.lo else boxes.to_rect(lo[i].tolist(), hi[i].tolist())
            )
            for req, lo, hi in zip(self.requirements, self.req_lo, self.req_hi)
        )
        ranks = tuple(self.ranks[self.rank_ptr[i] : self.rank_ptr[i + 1]].tolist())
        return Piece(ranks, rect, requirements)

    def pieces(self, which: np.ndarray | None = None) -> list[Piece]:
        """Every piece, in order, or those of the indices `which` (ascending)."""
        ranks = self.ranks.tolist()
        ptr = self.rank_ptr.tolist()
        index = range(len(self)) if which is None else which.tolist()

        def rows(lo: np.ndarray, hi: np.ndarray) -> list[Rect]:
            return boxes.to_rects(lo, hi) if which is None else boxes.to_rects(lo[which], hi[which])

        rects = rows(self.lo, self.hi)
        columns = [
            [_with_rect(req, rect) for rect in (rects if lo is self.lo else rows(lo, hi))]
            for req, lo, hi in zip(self.requirements, self.req_lo, self.req_hi)
        ]
        return [
            Piece(tuple(ranks[ptr[i] : ptr[i + 1]]), rect, tuple(col[k] for col in columns))
            for k, (i, rect) in enumerate(zip(index, rects))
        ]

    def pieces_of(self, ranks: np.ndarray) -> list[Piece]:
        """The pieces some rank of `ranks` computes, in order."""
        mine = np.isin(self.ranks, ranks)
        if mine.all():
            return self.pieces()
        piece_of = np.repeat(np.arange(len(self)), np.diff(self.rank_ptr))
        return self.pieces(np.unique(piece_of[mine]))


def _with_rect(req: Requirement, rect: Rect) -> Requirement:
    """`access.with_rect` without `dataclasses.replace` (this runs once per piece and role)."""
    privilege = req.privilege
    return Requirement(
        req.tensor,
        req.role,
        privilege,
        rect if privilege.reads else None,
        rect if privilege.writes else None,
    )


def grid_pieces(
    graph: TaskGraph, task: Task, grid: Sequence[int], memo: dict | None = None
) -> PieceSet:
    """The non-empty cells of `grid` over `task`'s space, cell i on rank i.

    `memo` keeps the access map's answers for the task's shape (see `PieceCache`) across grids:
    grids that cut a dim the same way share its probes."""
    if len(grid) != task.space.ndim:
        raise ValueError(f"grid {list(grid)} for task {task.name} over a {task.space.ndim}-d space")
    ranks, lo, hi, bounds, coords = boxes.grid_cells(task.space, grid)
    dims = task.role_dims(graph.tensors)
    rects = None
    if len(ranks) > DIRECT_LIMIT:
        memo = {} if memo is None else memo
        boxed = box_map(task.op, task.phase)
        if boxed is not None:
            rects = _boxed(task, dims, boxed, bounds, coords, lo, hi, memo)
        if rects is None:
            rects = _probed(task, dims, bounds, coords, lo, hi, memo)
    if rects is None:
        rects = _direct(task, dims, lo, hi)
    ptr = np.arange(len(ranks) + 1, dtype=boxes.INDEX)
    return PieceSet(
        lo,
        hi,
        ptr,
        ranks,
        reduction_split.piece_requirements(task, tuple(grid)),
        [rects[req.role][0] for req in task.requirements],
        [rects[req.role][1] for req in task.requirements],
        reduction_split.sum_targets(task, tuple(grid)),
    )


class PieceCache:
    """Grid pieces of one graph's tasks by (task, grid), for planning it under many strategies
    (`auto` prices dozens of plans that share most of their grids).

    Tasks that differ only in the tensors they touch (the same op, phase, attributes, space and
    tensor dims per role, as the repeated layers of VGG have, and a layer's copies in each
    micro-batch, whose attributes differ only in where they sit, `PLACEMENT_ATTRS`) get the same
    rects, so they share one computation of them."""

    def __init__(self, graph: TaskGraph) -> None:
        # held weakly: the graph's own cache (`graph_pieces`) must not keep its graph alive
        self._graph = ref(graph)
        #: the transfers and layouts its plans found, by content (`plan_memo`): plans of one
        #: graph under many strategies share the tasks whose grids they share
        self.memo = PlanMemo()
        self._found: dict[tuple[str, tuple[int, ...]], PieceSet] = {}
        self._shapes: dict[tuple, PieceSet] = {}
        self._memos: dict[tuple, dict] = {}

    @property
    def graph(self) -> TaskGraph | None:
        """The graph it serves (None once that graph is gone)."""
        return self._graph()

    def get(self, graph: TaskGraph, task: Task, grid: Sequence[int]) -> PieceSet:
        if graph is not self.graph:
            raise ValueError("a PieceCache serves the graph it was made for")
        key = (task.name, tuple(grid))
        found = self._found.get(key)
        if found is None:
            shape = _shape_key(graph, task, tuple(grid))
            same = self._shapes.get(shape) if shape is not None else None
            if same is None:
                memo = self._memos.setdefault(shape[:-1], {}) if shape is not None else None
                found = grid_pieces(graph, task, grid, memo)
                if shape is not None:
                    self._shapes[shape] = found
            else:
                found = PieceSet(
                    same.lo,
                    same.hi,
                    same.rank_ptr,
                    same.ranks,
                    reduction_split.piece_requirements(task, tuple(grid)),
                    same.req_lo,
                    same.req_hi,
                    same.sums,
                )
            self._found[key] = found
        return found


#: per graph alive, the pieces its plans share (`graph_pieces`)
_OF_GRAPH: WeakKeyDictionary[TaskGraph, PieceCache] = WeakKeyDictionary()


def graph_pieces(graph: TaskGraph) -> PieceCache:
    """The pieces that every plan of `graph` shares, found once per task and grid while the
    graph lives (and gone with it): a command's search, its memory fit and its report plan the
    same tasks on the same grids (`build_plan`'s default)."""
    found = _OF_GRAPH.get(graph)
    if found is None:
        found = _OF_GRAPH[graph] = PieceCache(graph)
    return found


def keep_pieces(cache: PieceCache, grids: Mapping[str, tuple[int, ...]]) -> None:
    """Add to `graph_pieces` what `cache` (a search's own, which holds every grid it tried) has
    found of the tasks on `grids` (task name -> grid): the grids it chose, which the plans of
    its result then take rather than find again."""
    shared = graph_pieces(cache.graph)
    for name, grid in grids.items():
        found = cache._found.get((name, tuple(grid)))
        if found is not None:
            shared._found.setdefault((name, tuple(grid)), found)


def _shape_key(graph: TaskGraph, task: Task, grid: tuple[int, ...]) -> tuple | None:
    """What `grid_pieces` computes the rects from (None: attributes that do not compare)."""
    try:
        attrs = repr(sorted(kv for kv in task.attrs.items() if kv[0] not in PLACEMENT_ATTRS))
    except TypeError:
        return None
    roles = tuple((req.role, graph.tensors[req.tensor].dims) for req in task.requirements)
    return (task.op, task.phase, attrs, roles, task.space.lo, task.space.hi, grid)


def _direct(
    task: Task, dims: Mapping[str, tuple[int, ...]], lo: np.ndarray, hi: np.ndarray
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    fn = access_map(task.op, task.phase)
    found: dict[str, list[Rect]] = {role: [] for role in dims}
    for piece in boxes.to_rects(lo, hi):
        rects = fn(task.attrs, dims, piece)
        for role, column in found.items():
            column.append(rects[role])
    return {role: boxes.from_rects(column, len(dims[role])) for role, column in found.items()}


def _probed(
    task: Task,
    dims: Mapping[str, tuple[int, ...]],
    bounds: list[np.ndarray],
    coords: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    memo: dict,
) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """Requirement rects of every piece from the probes, or None where the map is not separable."""
    fn = access_map(task.op, task.phase)
    space = task.space
    call = _memoised(task, dims, memo)
    cut = [d for d, b in enumerate(bounds) if len(b) > 1]
    probes = {d: _probes(d, bounds[d], space, dims, fn, task.attrs, memo) for d in cut}
    out = {}
    for role, tensor_dims in dims.items():
        ndim = len(tensor_dims)
        role_lo = np.full((len(lo), ndim), np.iinfo(boxes.INDEX).min, boxes.INDEX)
        role_hi = np.full((len(lo), ndim), np.iinfo(boxes.INDEX).max, boxes.INDEX)
        movers = np.zeros(ndim, boxes.INDEX)
        for d in cut:
            probe_lo, probe_hi, moves = probes[d][role]
            movers += moves
            np.maximum(role_lo, probe_lo[coords[d]], out=role_lo)
            np.minimum(role_hi, probe_hi[coords[d]], out=role_hi)
        if np.any(movers > 1):
            return None
        if not cut:
            whole = call(space.lo, space.hi)[role]
            role_lo[:], role_hi[:] = whole.lo, whole.hi
        out[role] = _zero_empty(role_lo, role_hi)
    return out if _agrees(out, call, coords, cut, lo, hi) else None


def _boxed(
    task: Task,
    dims: Mapping[str, tuple[int, ...]],
    boxed: BoxMap,
    bounds: list[np.ndarray],
    coords: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    memo: dict,
) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """Requirement rects of every piece from the op's array map (`box_map`), or None where
    they differ from the layer's own map on the sampled pieces."""
    out = {}
    for role, (role_lo, role_hi) in boxed(task.attrs, dims, lo, hi).items():
        shape = (len(lo), len(dims[role]))
        role_lo = np.array(np.broadcast_to(role_lo, shape), boxes.INDEX)
        role_hi = np.array(np.broadcast_to(role_hi, shape), boxes.INDEX)
        out[role] = _zero_empty(role_lo, role_hi)
    cut = [d for d, b in enumerate(bounds) if len(b) > 1]
    return out if _agrees(out, _memoised(task, dims, memo), coords, cut, lo, hi) else None


def _memoised(task: Task, dims: Mapping[str, tuple[int, ...]], memo: dict):
    """The task's access map on a piece given as bounds, its answers kept in `memo`."""
    fn = access_map(task.op, task.phase)

    def call(piece_lo: Sequence[int], piece_hi: Sequence[int]) -> dict[str, Rect]:
        key = ("call", tuple(piece_lo), tuple(piece_hi))
        found = memo.get(key)
        if found is None:
            found = memo[key] = fn(task.attrs, dims, boxes.to_rect(piece_lo, piece_hi))
        return found

    return call


def _zero_empty(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Empty rects as the access maps give them, all zeros (in place)."""
    empty = ~boxes.nonempty(lo, hi)
    lo[empty] = 0
    hi[empty] = 0
    return lo, hi


def _agrees(out, call, coords: np.ndarray, cut: list[int], lo: np.ndarray, hi: np.ndarray) -> bool:
    """Whether the rects `out` gives the sampled pieces are those of the access map (`call`)."""
    chosen = _sample(coords, cut)
    expected = [call(a, b) for a, b in zip(lo[chosen].tolist(), hi[chosen].tolist())]
    for role, (role_lo, role_hi) in out.items():
        # bounds compared as tuples: a Rect per sampled piece and role would cost more
        got = zip(role_lo[chosen].tolist(), role_hi[chosen].tolist())
        for rects, (a, b) in zip(expected, got):
            rect = rects[role]
            if rect.lo != tuple(a) or rect.hi != tuple(b):
                return False
    return True


def _probes(d, bounds, space, dims, fn, attrs, memo) -> dict[str, tuple[np.ndarray, ...]]:
    """Per role, the rects (lo, hi) of the space cut only along dim d at `bounds`, one per part
    (empty for an empty part), and which dims of them move with the part."""
    key = ("probes", d, bounds.tobytes())
    found = memo.get(key)
    if found is not None:
        return found
    lo, hi = tuple(space.lo), tuple(space.hi)
    head_lo, tail_lo, head_hi, tail_hi = lo[:d], lo[d + 1 :], hi[:d], hi[d + 1 :]
    to_rect = boxes.to_rect
    probes = [
        fn(attrs, dims, to_rect(head_lo + (a,) + tail_lo, head_hi + (b,) + tail_hi))
        if b > a
        else None
        for a, b in bounds.tolist()
    ]
    used = np.array([p is not None for p in probes])
    found = {}
    for role, tensor_dims in dims.items():
        ndim = len(tensor_dims)
        if used.all():
            found[role] = _role_probes(list(map(itemgetter(role), probes)), ndim)
            continue
        rects = [None if p is None else p[role] for p in probes]
        blank = (0,) * (2 * ndim)
        both = np.array([blank if r is None else r.lo + r.hi for r in rects], boxes.INDEX)
        probe_lo, probe_hi = both[:, :ndim], both[:, ndim:]
        moves = np.any(probe_lo[used] != probe_lo[used][0], axis=0) | np.any(
            probe_hi[used] != probe_hi[used][0], axis=0
        )
        found[role] = (probe_lo, probe_hi, moves)
    memo[key] = found
    return found


def _role_probes(rects: list[Rect], ndim: int) -> tuple[np.ndarray, ...]:
    """`_probes`' (lo, hi, moves) of one role from its rect in every (non-empty) part.

    The bounds are gathered as tuples and compared with `list.count`, which stays in C: this
    runs for every part of every cut dim of every role, some 10⁵ rects at 1024 ranks."""
    count = len(rects)
    los, his = list(map(_lo_of, rects)), list(map(_hi_of, rects))
    if los.count(los[0]) == count and his.count(his[0]) == count:  # the part does not move it
        one = np.array(los[0] + his[0], boxes.INDEX).reshape(1, 2 * ndim)
        both = np.broadcast_to(one, (count, 2 * ndim))
        return both[:, :ndim], both[:, ndim:], np.zeros(ndim, bool)
    probe_lo = np.array(los, boxes.INDEX).reshape(count, ndim)
    probe_hi = np.array(his, boxes.INDEX).reshape(count, ndim)
    moves = np.any(probe_lo != probe_lo[0], axis=0) | np.any(probe_hi != probe_hi[0], axis=0)
    return probe_lo, probe_hi, moves


def _sample(coords: np.ndarray, cut: list[int]) -> list[int]:
    """Pieces to check: every corner of the grid over the cut dims, its centre, and a few more."""
    count = coords.shape[1]
    chosen = set()
    extremes = [(coords[d].min(), coords[d].max()) for d in cut]
    for corner in product(*extremes):
        match = np.ones(count, bool)
        for d, value in zip(cut, corner):
            match &= coords[d] == value
        chosen.update(np.flatnonzero(match).tolist())
    chosen.add(count // 2)
    chosen.update(_random_pieces(count))
    return sorted(chosen)


@cache
def _random_pieces(count: int) -> tuple[int, ...]:
    """`SAMPLE` pieces of `count`, drawn by a generator seeded with `count` (kept: making the
    generator costs more than the rest of `_sample`, and grids of equal size recur)."""
    rng = np.random.default_rng(count)
    return tuple(rng.choice(count, size=min(SAMPLE, count), replace=False).tolist())


def homed_pieces(graph: TaskGraph, task: Task, homes: Mapping[str, Layout]) -> list[PieceSet]:
    """One piece per home cell the task touches, run by every holder of the cell.

    The data task loads each of its tensors over that tensor's home; other homed tasks run over
    the home of their first tensor, every requirement touching the piece."""
    if task.op == "data":
        return [_home_cells(homes[req.tensor], req.rect, (req,)) for req in task.requirements]
    home = homes[next(r.tensor for r in task.requirements if r.tensor in homes)]
    return [_home_cells(home, task.space, task.requirements)]


def _home_cells(home: Layout, rect: Rect, requirements: tuple[Requirement, ...]) -> PieceSet:
    lo, hi = boxes.from_rects([rect], rect.ndim)
    _, cells, part_lo, part_hi = boxes.grid_overlaps(home.cut_arrays, lo, hi)
    held = home.holder_count[cells] > 0
    cells, part_lo, part_hi = cells[held], part_lo[held], part_hi[held]
    ptr, ranks = boxes.gather_ragged(home.holder_ptr, home.holder_ranks, cells)
    return PieceSet(
        part_lo,
        part_hi,
        ptr,
        ranks,
        tuple(requirements),
        [part_lo] * len(requirements),
        [part_hi] * len(requirements),
    )
