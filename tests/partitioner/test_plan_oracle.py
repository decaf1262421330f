"""The array planner against a brute-force oracle, on random small networks and grids.

The oracle knows nothing of layouts, cells or arrays: it calls the access maps piece by piece,
keeps for every tensor a boolean mask per rank of the elements that rank holds, and checks each
task element by element:

- pieces: the planner's (probed) pieces equal direct access-map calls on every grid cell, and a
  homed task's pieces cover exactly what each rank holds of its tensor;
- reads: every element a piece reads that its rank does not hold (and did not receive for the
  same rect since the tensor was last written) arrives exactly once, from a rank holding it;
  nothing else arrives;
- reductions: every contributor's partial sum of an element reaches every other holder of the
  element exactly once, by a `reduce` transfer or by a collective both take part in; a
  collective's targets name exactly the ranks holding them;
- costs: FLOPs, bytes sent, link times and memory per rank (with the messages' staging) equal
  a recomputation over the `Piece`, `Transfer` and `Reduction` objects, the way the model was
  first written.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import product
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import partitioner.pieces as pieces_module
from legion_nn.ir import Requirement, Task
from legion_nn.networks import load_network
from legion_nn.op_records import piece_requirements, record_of
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner import boxes
from partitioner.accounting import bytes_per_rank, flops_per_element
from partitioner.collective_prices import reduction_cost
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.pieces import Piece, grid_pieces
from partitioner.plan import build_plan
from partitioner.reduction_split import output_grid
from partitioner.strategy import builtin, is_homed, param_of
from partitioner.transfers import TransferSet
from tests.plan_cases import networks, strategies

MACHINE = Machine(100, 12.5, 2, 16)


def box(dims, rect: Rect) -> np.ndarray:
    out = np.zeros(dims, bool)
    out[rect.to_slices()] = True
    return out


def sums_cut(task: Task, grid) -> bool:
    """Whether `grid` cuts a dim the task sums over (the last `sums_over` of its space)."""
    summed = record_of(task.op).sums_over
    return summed > 0 and any(parts > 1 for parts in grid[len(grid) - summed :])


def direct_pieces(graph, task: Task, grid) -> list[Piece]:
    """Piece i of the grid on rank i, its requirements from the access map, each write a
    partial sum (`reduce`) where the grid cuts a dim the task sums over."""
    partial = sums_cut(task, grid)
    out = []
    for rank, rect in enumerate(task.space.split(grid)):
        if rect.is_empty():
            continue
        requirements = tuple(
            Requirement(r.tensor, r.role, Privilege.REDUCE, None, r.write_rect)
            if partial and r.privilege is Privilege.WRITE
            else r
            for r in piece_requirements(task, graph.tensors, rect)
        )
        out.append(Piece((rank,), rect, requirements))
    return out


def initial_holdings(graph, plan, nranks: int) -> dict[str, np.ndarray]:
    """Resident tensors live where their readers read them (rank 0 when nobody does)."""
    held: dict[str, np.ndarray] = {}
    read: dict[str, bool] = defaultdict(bool)
    for name, tensor in graph.tensors.items():
        if tensor.kind in ("data", "param"):
            held[name] = np.zeros((nranks, *tensor.dims), bool)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if is_homed(graph, task):
            continue
        for piece in direct_pieces(graph, task, task_plan.grid):
            for req in piece.requirements:
                if req.privilege.reads and req.tensor in held:
                    read[req.tensor] = True
                    held[req.tensor][piece.ranks[0]] |= box(held[req.tensor].shape[1:], req.rect)
    for name, mask in held.items():
        if not read[name]:
            mask[0] = True
    for name in graph.tensors:
        owner = param_of(graph, name)
        if owner is not None and name not in held:
            held[name] = held[owner].copy()
    return held


def check_homed(graph, task: Task, task_plan, held) -> None:
    reqs = task.requirements if task.op == "data" else task.requirements[:1]
    for req in reqs:
        rect = req.rect if task.op == "data" else task.space
        dims = graph.tensors[req.tensor].dims
        covered = np.zeros((len(held[req.tensor]), *dims), bool)
        for piece in task_plan.pieces:
            if piece.requirements[0].tensor == req.tensor:
                assert all(r.rect == piece.rect for r in piece.requirements)
                for rank in piece.ranks:
                    assert not (covered[rank] & box(dims, piece.rect)).any()
                    covered[rank] |= box(dims, piece.rect)
        assert (covered == (held[req.tensor] & box(dims, rect))).all(), task.name


def check_reads(graph, task, pieces, task_plan, held, copies) -> set:
    expected: dict[str, np.ndarray] = {}
    fresh = set()
    for piece in pieces:
        rank = piece.ranks[0]
        for req in piece.requirements:
            if not req.privilege.reads or req.read_rect.is_empty():
                continue
            t = req.tensor
            expected.setdefault(t, np.zeros(held[t].shape, int))
            if (t, req.read_rect, rank) not in copies:
                expected[t][rank] += box(held[t].shape[1:], req.read_rect) & ~held[t][rank]
                fresh.add((t, req.read_rect, rank))
    for transfer in task_plan.transfers:
        if transfer.reduce:
            continue
        t = transfer.tensor
        assert held[t][transfer.src][transfer.rect.to_slices()].all(), "sent by a non-holder"
        assert transfer.nbytes == transfer.rect.volume * graph.tensors[t].itemsize
        expected.setdefault(t, np.zeros(held[t].shape, int))
        for dst in transfer.dsts:
            expected[t][dst] -= box(held[t].shape[1:], transfer.rect)
    for _, gather in task_plan.gathered:  # each part, from its owner, to every other participant
        t = gather.tensor
        expected.setdefault(t, np.zeros(held[t].shape, int))
        for (rect, holders), owner in zip(gather.targets, gather.owners):
            assert set(holders) | {owner} <= set(gather.participants)
            assert held[t][owner][rect.to_slices()].all(), "gathered from a non-holder"
            for dst in holders:
                if dst != owner:
                    expected[t][dst] -= box(held[t].shape[1:], rect)
    for t, balance in expected.items():
        assert not balance.any(), f"{task.name}: {t} arrives wrongly"
    return fresh


def check_reductions(graph, task, pieces, task_plan, held) -> None:
    contributions: dict[str, dict[Rect, list[int]]] = defaultdict(lambda: defaultdict(list))
    for piece in pieces:
        for req in piece.requirements:
            if req.privilege is Privilege.REDUCE and not req.write_rect.is_empty():
                contributions[req.tensor][req.write_rect].append(piece.ranks[0])
    for t, by_rect in contributions.items():
        h = held[t]
        n, dims = len(h), h.shape[1:]
        balance = np.zeros((n, n, *dims), int)
        for rect, ranks in by_rect.items():
            for c in ranks:
                for dst in range(n):
                    if dst != c:
                        balance[c, dst] += box(dims, rect) & h[dst]
        for transfer in task_plan.transfers:
            if transfer.reduce and transfer.tensor == t:
                for dst in transfer.dsts:
                    assert h[dst][transfer.rect.to_slices()].all(), "partial sum to a non-holder"
                    balance[transfer.src, dst] -= box(dims, transfer.rect)
        for reduction in task_plan.reductions:
            if reduction.tensor != t:
                continue
            for target, holders in reduction.targets:
                full = tuple(r for r in range(n) if h[r][target.to_slices()].all())
                assert holders == full and set(holders) <= set(reduction.participants)
                for rect, ranks in by_rect.items():
                    region = box(dims, target) & box(dims, rect)
                    for c in ranks:
                        if c in reduction.summed_from:
                            for dst in holders:
                                if dst != c:
                                    balance[c, dst] -= region
        assert not balance.any(), f"{task.name}: partial sums of {t} reach holders wrongly"


def link_time(transfers, machine: Machine) -> float:
    if not transfers:
        return 0.0
    sent: dict[int, float] = defaultdict(float)
    received: dict[int, float] = defaultdict(float)
    messages: dict[int, float] = defaultdict(float)
    for t in transfers:
        rounds = math.ceil(math.log2(len(t.dsts) + 1))
        sent[t.src] += t.nbytes
        messages[t.src] += rounds
        for dst in t.dsts:
            received[dst] += t.nbytes
            messages[dst] += rounds
    return max(
        messages[r] * machine.alpha + max(sent[r], received[r]) * machine.beta
        for r in set(sent) | set(received)
    )


def check_costs(graph, plan) -> None:
    cost = plan_cost(graph, plan, MACHINE)
    memory: Counter = Counter({rank: 0 for rank in range(plan.nranks)})
    for name, layout in plan.layouts.items():
        for rank, volume in layout.volumes_by_rank().items():
            memory[rank] += volume * graph.tensors[name].itemsize
    for name, layout in plan.homes.items():
        if plan.layouts.get(name) is not layout:
            for rank, volume in layout.volumes_by_rank().items():
                memory[rank] += volume * graph.tensors[name].itemsize
    seen = set()
    traffic = bytes_per_rank(graph, plan)
    for k, (task, task_plan, task_cost) in enumerate(zip(graph.tasks, plan.tasks, cost.tasks)):
        flops: Counter = Counter()
        touched = np.zeros(plan.nranks)
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                flops[rank] += flops_per_element(task, graph) * piece.rect.volume
                for req in piece.requirements if task.op != "data" else ():  # loads: unpriced
                    updates = req.privilege in (Privilege.READ_WRITE, Privilege.REDUCE)
                    size = req.rect.volume * graph.tensors[req.tensor].itemsize
                    touched[rank] += size * (2 if updates else 1)
        assert task_cost.flops_max == max(flops.values(), default=0.0)
        assert task_cost.flops_total == sum(flops.values())
        np.testing.assert_array_equal(traffic[k], touched)
        transfers = task_plan.transfers
        comm = link_time([t for t in transfers if not t.reduce], MACHINE)
        comm += link_time([t for t in transfers if t.reduce], MACHINE)
        sent = sum(t.nbytes * len(t.dsts) for t in transfers)
        busy: Counter = Counter()
        for block, gather in task_plan.gathered:
            seconds, wire = reduction_cost(gather, MACHINE)
            sent += wire
            for rank in gather.participants:
                busy[rank] += seconds
                memory[rank] += gather.nbytes  # its flat vector
            for t in TransferSet((block,)).transfers():  # the parts it brings, once each
                for dst in t.dsts:
                    if (t.tensor, t.rect, dst) not in seen:
                        seen.add((t.tensor, t.rect, dst))
                        memory[dst] += t.nbytes
        for reduction in task_plan.reductions:
            seconds, wire = reduction_cost(reduction, MACHINE)
            sent += wire
            for rank in reduction.participants:
                busy[rank] += seconds
                owned = sum(
                    rect.volume * reduction.itemsize
                    for rect, holders in reduction.targets
                    if rank in holders
                )
                # its partial sum where it owns none of it, and its collective's buffer
                memory[rank] += 2 * reduction.nbytes - owned
        comm += max(busy.values(), default=0.0)
        assert task_cost.bytes_sent == sent
        assert task_cost.comm_s == pytest.approx(comm, rel=1e-12, abs=1e-15)
        for t in transfers:
            if t.reduce:  # a partial sum, and its receive buffers
                memory[t.src] += t.nbytes
                for dst in t.dsts:
                    memory[dst] += t.nbytes
            else:  # a send buffer per destination
                memory[t.src] += t.nbytes * len(t.dsts)
            for dst in t.dsts if not t.reduce else ():
                if (t.tensor, t.rect, dst) not in seen:
                    seen.add((t.tensor, t.rect, dst))
                    memory[dst] += t.nbytes
    assert cost.memory == dict(memory)
    rows = sum(cost.memory_by_unit.values())
    assert rows.tolist() == [cost.memory[r] for r in range(plan.nranks)]


def check_plan(graph, strategy, nranks: int) -> None:
    plan = build_plan(graph, strategy, nranks)
    held = initial_holdings(graph, plan, nranks)
    copies: set = set()
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task_plan.grid is None:
            check_homed(graph, task, task_plan, held)
            continue
        pieces = direct_pieces(graph, task, task_plan.grid)
        assert list(task_plan.pieces) == pieces, task.name
        copies |= check_reads(graph, task, pieces, task_plan, held, copies)
        written = {
            req.tensor
            for req in task.requirements
            if req.privilege.writes and req.privilege is not Privilege.REDUCE
        }
        for t in written:
            held[t] = np.zeros((nranks, *graph.tensors[t].dims), bool)
            copies = {c for c in copies if c[0] != t}
        if sums_cut(task, task_plan.grid):  # the sums land on the sum grid, cell i on rank i
            for t in written:
                whole = task.requirements[[r.tensor for r in task.requirements].index(t)]
                cells = whole.write_rect.split(output_grid(task, task_plan.grid))
                for rank, rect in enumerate(cells):
                    held[t][rank] |= box(held[t].shape[1:], rect)
        else:
            for piece in pieces:
                for req in piece.requirements:
                    if req.tensor in written:
                        held[req.tensor][piece.ranks[0]] |= box(
                            held[req.tensor].shape[1:], req.rect
                        )
        check_reductions(graph, task, pieces, task_plan, held)
    check_costs(graph, plan)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(),
    nranks=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]),
    probe_all=st.booleans(),
    array_maps=st.booleans(),
    data=st.data(),
)
def test_planner_matches_the_element_oracle(graph, nranks, probe_all, array_maps, data):
    strategy = data.draw(strategies(graph, nranks))
    limit = 0 if probe_all else pieces_module.DIRECT_LIMIT
    # without the array maps (the records' `box_map`s) every op's rects come from probing
    box_map = pieces_module.box_map if array_maps else (lambda op, phase: None)
    with (
        mock.patch.object(pieces_module, "DIRECT_LIMIT", limit),
        mock.patch.object(pieces_module, "box_map", box_map),
    ):
        check_plan(graph, strategy, nranks)


@pytest.mark.parametrize("name", ["data", "model", "spatial"])
def test_builtin_strategies_match_the_oracle(name):
    graph = load_network("seed-lcn-small").lower(batch=4)
    check_plan(graph, builtin(graph, name, 6), 6)


def _counting(fn, calls):
    def wrapped(attrs, dims, piece):
        calls.append(piece)
        return fn(attrs, dims, piece)

    return wrapped


def test_probing_calls_a_separable_map_once_per_part_not_per_piece():
    graph = load_network("seed-lcn-small").lower(batch=2)
    task = graph.task("L0.filter")
    calls: list[Rect] = []
    real = pieces_module.access_map(task.op, task.phase)
    with (
        mock.patch.object(pieces_module, "access_map", lambda op, phase: _counting(real, calls)),
        mock.patch.object(pieces_module, "box_map", lambda op, phase: None),
    ):
        probed = grid_pieces(graph, task, (1, 1, 8, 8, 1))
    assert probed.pieces() == direct_pieces(graph, task, (1, 1, 8, 8, 1))
    assert len(calls) < 64 // 2


def test_a_map_that_is_not_separable_is_called_per_piece():
    graph = load_network("seed-lcn-small").lower(batch=2)
    task = graph.task("L0.filterNL")
    real = pieces_module.access_map(task.op, task.phase)

    def flattened(attrs, dims, piece):
        # the output's rows run over (row, col) pairs, as after a flatten: dim 2 follows dims 2
        # and 3 of the piece at once
        rects = dict(real(attrs, dims, piece))
        (n0, k0, p0, q0), (n1, k1, p1, q1) = piece.lo, piece.hi
        rects["output"] = Rect((n0, k0, p0 * 16 + q0, 0), (n1, k1, (p1 - 1) * 16 + q1, 1))
        return rects

    calls: list[Rect] = []
    with mock.patch.object(
        pieces_module, "access_map", lambda op, phase: _counting(flattened, calls)
    ):
        probed = grid_pieces(graph, task, (1, 1, 4, 4))
    expected = [
        flattened(
            task.attrs, {r.role: graph.tensors[r.tensor].dims for r in task.requirements}, p.rect
        )["output"]
        for p in direct_pieces(graph, task, (1, 1, 4, 4))
    ]
    got = [
        p.requirements[task.requirements.index(task.requirement("output"))].rect
        for p in probed.pieces()
    ]
    assert got == expected
    assert len(calls) >= 16


@st.composite
def cuts_and_boxes(draw):
    ndim = draw(st.integers(1, 3))
    cuts = [
        np.array(sorted(draw(st.sets(st.integers(0, 12), min_size=0, max_size=5))), np.int64)
        for _ in range(ndim)
    ]
    count = draw(st.integers(0, 6))
    lo = np.array(draw(st.lists(st.lists(st.integers(-2, 13), min_size=ndim, max_size=ndim),
                                min_size=count, max_size=count)), np.int64).reshape(count, ndim)  # fmt: skip
    size = np.array(draw(st.lists(st.lists(st.integers(-1, 8), min_size=ndim, max_size=ndim),
                                  min_size=count, max_size=count)), np.int64).reshape(count, ndim)  # fmt: skip
    return cuts, lo, lo + size


@settings(max_examples=200, deadline=None)
@given(case=cuts_and_boxes())
def test_grid_overlaps_enumerates_every_cell_a_box_meets_in_order(case):
    cuts, lo, hi = case
    expected = []
    shape = [max(len(c) - 1, 0) for c in cuts]
    for b in range(len(lo)):
        if not (hi[b] > lo[b]).all():
            continue
        for index, cell in enumerate(product(*[range(n) for n in shape])):
            part_lo = [max(c[i], v) for c, i, v in zip(cuts, cell, lo[b])]
            part_hi = [min(c[i + 1], v) for c, i, v in zip(cuts, cell, hi[b])]
            if all(a < z for a, z in zip(part_lo, part_hi)):
                expected.append((b, index, tuple(part_lo), tuple(part_hi)))
    box, cell, part_lo, part_hi = boxes.grid_overlaps(cuts, lo, hi)
    got = [
        (b, c, tuple(a), tuple(z))
        for b, c, a, z in zip(box.tolist(), cell.tolist(), part_lo.tolist(), part_hi.tolist())
    ]
    assert got == expected


@settings(max_examples=50, deadline=None)
@given(case=cuts_and_boxes())
def test_grid_overlaps_answers_equal_arguments_alike_and_read_only(case):
    """Asked again with equal arrays (copies, other integer types), the same answer, which no
    caller can change for the next."""
    cuts, lo, hi = case
    first = boxes.grid_overlaps(cuts, lo, hi)
    again = boxes.grid_overlaps([c.astype(np.int32) for c in cuts], lo.copy(), hi.astype(np.int32))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    for array in again:
        with pytest.raises(ValueError):
            array[...] = 0


def test_grid_overlaps_keeps_at_most_its_bytes(monkeypatch):
    cuts = [np.arange(0, 65, 8, dtype=np.int64)]
    monkeypatch.setattr(boxes, "_overlaps", {})
    monkeypatch.setattr(boxes, "_overlaps_bytes", [0])
    monkeypatch.setattr(boxes, "OVERLAPS_KEPT_BYTES", 200)
    for start in range(6):
        lo, hi = np.array([[start]], np.int64), np.array([[start + 20]], np.int64)
        boxes.grid_overlaps(cuts, lo, hi)
        kept = sum(a.nbytes for found in boxes._overlaps.values() for a in found)
        assert kept == boxes._overlaps_bytes[0] <= 200 or len(boxes._overlaps) == 1
    assert 1 <= len(boxes._overlaps) < 6
