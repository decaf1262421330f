"""A step simulated from its ranks flattened in shares (`runtime.step.simulated_in_shares`,
`compiled.flat_part`, `compiled.merged`): the same step, float for float, as every rank flattened
at once, whether the shares' programs are built apart (by forked processes) or read from one
build, on plans whose ranks all differ and on plans whose ranks share a class's program."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from legion_nn.sources import load_source_graph
from partitioner.cost import compute_per_rank
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from runtime.step.compiled import flat_part, flatten
from runtime.step.flat_step import merged
from runtime.step.links import Links
from runtime.step.loop import ADD, COMPUTE, POST, START, WAIT
from runtime.step.model import StepModel
from runtime.step.prediction import (
    IDLE_TASK_WORK,
    MESSAGE_WORK,
    every_rank_work,
    predict_step,
    priced,
    run_flat,
    simulate_compiled,
)
from runtime.step.programs import build_programs, ranks_all_differ
from runtime.step.rank_cpu import cpu_slowdown
from runtime.step.rank_parts import has_part, idle_ranks
from runtime.step.shared_programs import SharedPrograms
from runtime.step.simulated_in_shares import (
    balanced_shares,
    simulate_in_shares,
    simulated_and_placed_in_shares,
)
from tests.paths import FIXTURES
from tests.runtime.step.test_compiled import MACHINES

#: two ranks a host on a slow, half-duplex, bursting link whose stack takes CPU from the kernels
#: and whose messages are held while kernels run, with memory traffic and a per-message cost
#: priced: messages, hops and passes all shape the step
MACHINE = MACHINES["held-by-kernels"]

#: (network, batch, strategy, home, ranks): model and spatial splits and auto's mixtures, whose
#: ranks differ, and a data-parallel plan, whose ranks share a class's program within a share
CASES = [
    ("seed-lcn-small", 16, "model", "replicated", 8),
    ("seed-lcn-small", 16, "data", "replicated", 16),
    (str(FIXTURES / "residual_small.json"), 8, "auto", "replicated", 6),
    (str(FIXTURES / "digits_cnn.onnx"), 8, "spatial", "replicated", 8),
    (str(FIXTURES / "mlp_small.json"), 8, "model", "sharded", 5),
    # 12 outputs cut over 16 ranks: 4 ranks with a part in no task, skipped
    (str(FIXTURES / "narrowing.json"), 8, "model", "replicated", 16),
]


def _plan(network, batch, strategy, home, ranks):
    graph = load_source_graph(network, batch, batch)
    chosen, _ = resolve_strategy(graph, strategy, ranks, MACHINE, 5.0, None, home)
    return graph, build_plan(graph, chosen, ranks)


def _ids():
    return [f"{Path(c[0]).stem}-{c[2]}-{c[3]}-{c[4]}" for c in CASES]


def _same_step(one, other):
    assert one.seconds == other.seconds
    assert one.finish == other.finish
    assert one.waiting == other.waiting
    assert one.compute == other.compute


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_parts_merged_are_every_rank_flattened_at_once(case):
    """Flattened in three shares and merged, the instructions are those of every rank at once
    (their keys and seconds elsewhere in their arrays, each collective's instances numbered
    alike), and the compiled loop runs the same step over them."""
    graph, plan = _plan(*case)
    nranks = plan.nranks
    programs = build_programs(graph, plan, MACHINE, range(nranks))
    table = np.asarray(compute_per_rank(graph, plan, MACHINE)).reshape(-1, nranks)
    seconds, passes = priced(graph, plan, MACHINE, programs, table)
    slowdown = cpu_slowdown(MACHINE, programs, nranks)
    links = Links.of(MACHINE, nranks)
    whole = flatten(programs, seconds, links, passes, slowdown)
    shares = np.array_split(np.arange(nranks), 3)
    parts = [flat_part(programs, seconds, passes, slowdown, s.tolist()) for s in shares]
    split = merged(parts, links)
    assert split.ranks == whole.ranks == list(range(nranks))
    for name in ("op_ptr", "src", "dst", "nbytes", "host", "round_first", "round_count",
                 "round_adds"):  # fmt: skip
        assert np.array_equal(getattr(split, name), getattr(whole, name)), name
    assert np.array_equal(split.ops[:, 0], whole.ops[:, 0])
    # the same seconds for each ADD and COMPUTE (a share makes its own first rank of a class)
    for code, columns in ((ADD, [1]), (COMPUTE, [1, 2])):
        at = whole.ops[:, 0] == code
        for column in columns:
            assert np.array_equal(
                whole.amounts[whole.ops[at, column]], split.amounts[split.ops[at, column]]
            )
    assert np.array_equal(split.ops[split.ops[:, 0] == START], whole.ops[whole.ops[:, 0] == START])
    assert split.heap_room == whole.heap_room
    # every key range names the same transfers in the same order
    keyed = np.isin(whole.ops[:, 0], [POST, WAIT])
    for (lo, hi), (lo2, hi2) in zip(whole.ops[keyed, 1:], split.ops[keyed, 1:], strict=True):
        assert np.array_equal(whole.keys[lo:hi], split.keys[lo2:hi2])
    for lo, hi, lo2, hi2 in zip(whole.round_lo, whole.round_hi, split.round_lo, split.round_hi):
        assert np.array_equal(whole.keys[lo:hi], split.keys[lo2:hi2])
    _same_step(run_flat(whole, MACHINE, links, slowdown), run_flat(split, MACHINE, links, slowdown))


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_a_step_simulated_in_shares_is_the_step(case):
    """Each share's programs built, priced and flattened by a forked process of its own (two
    here, and the third share by this one), or every share here one after another: the step
    `predict_step` simulates from every rank's programs built at once."""
    graph, plan = _plan(*case)
    want = predict_step(graph, plan, MACHINE, simulate=simulate_compiled)
    for workers in (2, 0):
        _same_step(simulate_in_shares(graph, plan, MACHINE, workers), want)


def test_the_cases_cover_ranks_that_differ_and_ranks_alike():
    """The cases hold a plan whose every rank is built and one whose shares build a class's
    program once, so that both ways of flattening a rank (made, and given again) are merged."""
    kinds = set()
    for case in CASES:
        graph, plan = _plan(*case)
        built = build_programs(graph, plan, MACHINE, range(plan.nranks))
        kinds.add(isinstance(built, SharedPrograms))
    assert kinds == {True, False}


@pytest.mark.parametrize("case", CASES[2:4], ids=_ids()[2:4])
def test_a_report_whose_ranks_all_differ_is_built_placed_and_simulated_in_shares(case):
    """`partition`'s report of a plan whose ranks all differ, on up to 64 ranks: each share's
    programs built once, by a process of its own, for both its placed memory and its part of
    the step, gives the report every rank's programs built here give."""
    graph, plan = _plan(*case)
    assert ranks_all_differ(plan, range(plan.nranks))
    alone = StepModel(MACHINE).predictions(graph, plan)
    model = StepModel(MACHINE)
    with model.looking_ahead(workers=1):
        shared = model.predictions(graph, plan)
    assert model._built(graph, plan) is None  # no rank's program built here
    assert shared == alone
    step, placed = simulated_and_placed_in_shares(graph, plan, MACHINE, 2)
    assert len(placed) == 3
    assert sorted(r for share in placed for r in share.peaks) == list(range(plan.nranks))
    _same_step(step, predict_step(graph, plan, MACHINE, simulate=simulate_compiled))


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_shares_cover_the_ranks_in_order_each_about_an_equal_part_of_the_work(case):
    """Contiguous shares of the ranks, in order, none past an equal part of the work (a rank's
    tasks, its ends of the messages and its rounds of the collectives it joins) by more than one
    rank's."""
    graph, plan = _plan(*case)
    work = np.zeros(plan.nranks)
    parts = has_part(plan)
    for row, task_plan in enumerate(plan.tasks):
        with_part = set()
        for piece in task_plan.pieces:
            with_part.update(piece.ranks)
        for transfer in task_plan.transfers:
            with_part.update((transfer.src, *transfer.dsts))
        for block, gather in task_plan.gathered:
            with_part.update(gather.participants)
        for collective in task_plan.collectives:
            with_part.update(collective.participants)
        for layout in task_plan.holdings.values():
            with_part.update(r for holders in layout.holders.values() for r in holders)
        assert parts[row].tolist() == [r in with_part for r in range(plan.nranks)]
        for rank in range(plan.nranks):
            work[rank] += 1.0 if rank in with_part else IDLE_TASK_WORK
    work[idle_ranks(plan)] = 0.0
    for task_plan in plan.tasks:
        for transfer in task_plan.transfers:
            work[transfer.src] += MESSAGE_WORK / 2 * len(transfer.dsts)
            work[list(transfer.dsts)] += MESSAGE_WORK / 2
        collectives = [gather for _, gather in task_plan.gathered] + list(task_plan.reductions)
        for collective in collectives:
            rounds = math.ceil(math.log2(max(len(collective.participants), 2)))
            work[list(collective.participants)] += MESSAGE_WORK * rounds
    assert np.allclose(every_rank_work(graph, plan), work)
    for count in (2, 3):
        shares = balanced_shares(every_rank_work(graph, plan), count)
        assert np.array_equal(np.concatenate(shares), np.arange(plan.nranks))
        assert all(len(share) for share in shares) and len(shares) <= count
        for share in shares:
            assert work[share].sum() <= work.sum() / count + work.max() + 1e-9


def test_ranks_with_a_part_in_no_task_are_not_built_and_end_at_zero():
    """The narrowing network's 12 outputs cut over 16 ranks: ranks 12-15 have a part in no
    task and hold no home (`rank_parts.idle_ranks`); simulated in shares they are never built, carry
    no work, and end at 0 having waited and computed for 0, as every rank built gives them."""
    graph, plan = _plan(*CASES[-1])
    assert idle_ranks(plan).tolist() == [12, 13, 14, 15]
    assert not every_rank_work(graph, plan)[idle_ranks(plan)].any()
    step = simulate_in_shares(graph, plan, MACHINE, 0)
    for rank in idle_ranks(plan).tolist():
        assert step.finish[rank] == step.waiting[rank] == step.compute[rank] == 0.0
    assert step.seconds > 0
