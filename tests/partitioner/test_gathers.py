"""Whole-tensor reads as all-gathers (`partitioner.gathers`): which reads the planner gathers,
what the gathers move against the copies they replace, and `verify_plan` on them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from legion_nn.errors import VerifyError
from legion_nn.networks import load_network
from partitioner import gathers
from partitioner.collective_prices import reduction_cost
from partitioner.collectives import schedule
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from partitioner.task_plan import TaskPlan
from partitioner.verify_plan import verify_plan
from tests.paths import FIXTURES

MACHINE = Machine(latency_us=20.0)


def narrowing_network():
    """12 outputs, then 5: on 8 ranks the second layer's 5 readers gather parts that 8 hold."""
    return load_network(str(FIXTURES / "narrowing.json"))


def by_task(plan):
    return {task_plan.task: task_plan for task_plan in plan.tasks}


def model_plan(network: str, nranks: int, batch: int = 8):
    graph = load_network(network).lower(batch=batch)
    return graph, build_plan(graph, builtin(graph, "model", nranks), nranks)


@pytest.mark.parametrize("nranks", [3, 4, 5, 8])
def test_a_model_parallel_mlp_gathers_each_layers_input(nranks):
    """Every linear after the first reads all of the layer before, which its p ranks hold in p
    parts: each such read arrives by one all-gather, none by copies; the plan verifies, and
    the gather carries the copies' bytes where p is a power of two (folding a rank in and out
    costs its part twice more)."""
    graph, plan = model_plan("deep-mlp", nranks)
    verify_plan(graph, plan)
    gathered = {tp.task: tp.gathered for tp in plan.tasks if tp.gathered}
    assert sorted(gathered) == sorted(
        [f"fc{i}.linear{i}" for i in range(2, 9)] + ["classifier.linear9"]
    )
    for name, found in gathered.items():
        ((block, gather),) = found
        fetched = [b for b in by_task(plan)[name].transfer_set.blocks if len(b)]
        assert not [b for b in fetched if b.tensor == gather.tensor]
        assert gather.participants == tuple(range(nranks))
        assert sorted(gather.owners) == list(range(nranks))
        copies = int((block.nbytes * block.fanout).sum())
        rounds = schedule(gather, MACHINE)
        assert rounds.hops <= nranks * (math.ceil(math.log2(nranks)) + 2)
        if nranks & (nranks - 1) == 0:
            assert sum(rounds.sent(gather.itemsize).values()) == copies
            assert len(rounds) == int(math.log2(nranks))


def test_what_is_not_gathered():
    """On two ranks the one exchange is the copies'; a read of part of a tensor (a spatial
    split's halo) and a read whose data was added into after it was written stay copies."""
    graph, plan = model_plan("deep-mlp", 2)
    assert not any(tp.gathered for tp in plan.tasks)
    graph = load_network("seed-lcn-small").lower(batch=8)
    spatial = build_plan(graph, builtin(graph, "spatial", 4), 4)
    assert not any(tp.gathered for tp in spatial.tasks)
    reduced = {tp.task: tp for tp in model_plan("deep-mlp", 4)[1].tasks}
    assert not reduced["classifier.linear9.grad"].gathered  # its input gradient: a sum


def test_holders_that_do_not_read_hand_their_parts_on():
    """A layer of 12 outputs on 8 ranks read by one of 5: the gather's participants are the 8
    holders, its targets held after by the 5 readers, and the plan verifies."""
    graph = narrowing_network().lower(batch=4)
    plan = build_plan(graph, builtin(graph, "model", 8), 8)
    verify_plan(graph, plan)
    ((_, gather),) = by_task(plan)["classifier.linear2"].gathered
    readers = gather.targets[0][1]
    assert len(readers) == 5 and gather.participants == tuple(range(8))
    assert set(gather.owners) == set(range(8))
    held = {rank: 0 for rank in readers}
    for rect, _ in gather.targets:
        for rank in readers:
            held[rank] += rect.volume
    assert set(held.values()) == {graph.tensors[gather.tensor].volume}


def with_collectives(plan, index: int, reductions, gathered):
    """`plan` with the task at `index` summing by `reductions` and gathering by `gathered`."""
    task_plan = plan.tasks[index]
    tasks = list(plan.tasks)
    tasks[index] = TaskPlan(
        task_plan.task,
        task_plan.unit,
        task_plan.grid,
        task_plan.piece_sets,
        task_plan.transfer_set,
        reductions,
        task_plan.holdings,
        task_plan.deferred,
        gathered,
    )
    return replace(plan, tasks=tasks)


def test_sums_into_parts_their_contributors_do_not_hold_are_one_reduce_scatter():
    """The classifier's input gradient on 8 ranks: its 5 ranks' sums into the 12 outputs' 8
    holders are one reduce-scatter among the 5 whose partners hand the 3 others their sums
    (not one reduce a part outside the 5); it verifies, moves what the cost model says, and
    a plan that leaves a contributor out of its contributors is refused."""
    graph = narrowing_network().lower(batch=4)
    plan = build_plan(graph, builtin(graph, "model", 8), 8)
    verify_plan(graph, plan)
    index = next(i for i, tp in enumerate(plan.tasks) if tp.task == "classifier.linear2.grad")
    task_plan = plan.tasks[index]
    (scatter,) = task_plan.reductions
    assert scatter.algorithm == "reduce_scatter" and scatter.participants == tuple(range(8))
    assert scatter.contributors == tuple(range(5))
    assert sorted(h for _, (h,) in scatter.targets) == list(range(8))
    built = schedule(scatter, MACHINE)
    last = built[len(built) - 1]
    assert {(hop.src, hop.dst) for hop in last} == {(0, 5), (1, 6), (2, 7)}  # partners hand
    assert max(built.src.tolist()) < 5  # the extras send nothing
    assert sum(built.sent(scatter.itemsize).values()) == reduction_cost(scatter, MACHINE)[1]
    broken = with_collectives(
        plan, index, [replace(scatter, contributors=scatter.contributors[1:])], task_plan.gathered
    )
    with pytest.raises(VerifyError, match="rank 0's partial sum .* never reaches"):
        verify_plan(graph, broken)


def test_verify_plan_refuses_a_gather_from_a_rank_without_the_part():
    graph, plan = model_plan("deep-mlp", 4)
    index = next(i for i, tp in enumerate(plan.tasks) if tp.gathered)
    task_plan = plan.tasks[index]
    ((block, gather),) = task_plan.gathered
    owners = gather.owners[1:] + gather.owners[:1]
    broken = with_collectives(
        plan, index, task_plan.reductions, [(block, replace(gather, owners=owners))]
    )
    with pytest.raises(VerifyError, match="all-gather .* does not hold it"):
        verify_plan(graph, broken)


def test_gathers_are_priced_in_the_readers_row_and_cut_its_messages():
    """The plan's cost prices each gather in its reader's row: on 64 ranks deep-mlp's model plan
    sends the same bytes in 64·6 hops a layer where its copies were 64·63 messages."""
    graph, plan = model_plan("deep-mlp", 64)
    cost = plan_cost(graph, plan, MACHINE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gathers, "LEAST_PARTICIPANTS", 10**9)
        copied = build_plan(graph, builtin(graph, "model", 64), 64)
    copies = plan_cost(graph, copied, MACHINE)
    assert cost.bytes_sent == copies.bytes_sent
    rows, rows_copied = cost.unit_seconds(), copies.unit_seconds()
    assert rows["fc2"] < rows_copied["fc2"]  # 6 rounds of α, not 63
    assert cost.memory != copies.memory  # a flat vector where copies had send buffers
