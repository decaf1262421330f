"""The step simulator against steps worked out by hand, and against the bounds any schedule of a
real plan must respect."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from legion_nn.ir import Task
from legion_nn.networks import load_network
from legion_nn.rect import Rect
from partitioner.collectives import Hop
from partitioner.cost import compute_per_rank, loads_time
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from partitioner.task_plan import Reduction
from runtime.step.links import Links
from runtime.step.local_passes import TaskPasses
from runtime.step.prediction import predict_step, simulate_compiled
from runtime.step.programs import build_programs
from runtime.step.rank_cpu import sharing_core
from runtime.step.rank_messages import Message
from runtime.step.rank_program import Collective, RankProgram, RankTask
from runtime.step.simulator import simulate_step

MACHINE = Machine(memory_gbytes_per_s=None)


def task(name: str) -> Task:
    return Task(name, "relu", "forward", (1,), {}, (), Rect((0,), (1,)))


def program(rank: int, tasks: list[RankTask], start: list[Message] = ()) -> RankProgram:
    return RankProgram(rank, 2, tasks, list(start), {}, 0, 0)


def links(alpha=0.1, beta=1e-6, per_host=1, alpha_intra=0.0, beta_intra=1e-9) -> Links:
    return Links(alpha, beta, alpha_intra, beta_intra, per_host)


def test_a_copy_moves_once_both_ends_posted_and_its_reader_waits_for_it():
    m = Message(0, "x", Rect((0,), (1,)), 0, 1, 1_000_000, 1, 0, False)
    programs = {
        0: program(0, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"))]),
        1: program(1, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"), copies_in=[m])]),
    }
    compute = {0: [1.0, 1.0], 1: [0.5, 1.0]}
    step = simulate_step(programs, compute, MACHINE, links())
    # ready at 1.0 (the sender's post), 0.1 + 1.0 s on the link; the reader waits from 0.5
    assert step.finish[1] == pytest.approx(3.1)
    assert step.finish[0] == pytest.approx(2.1)  # its send seen off
    assert step.seconds == pytest.approx(3.1)
    assert step.waiting[1] == pytest.approx(1.6)


def two_round_allreduce(nbytes: int) -> Collective:
    n = nbytes // 4
    reduction = Reduction("g", "allreduce", (0, 1), ((Rect((0,), (2 * n,)), (0, 1)),), 4)
    rounds = [
        [Hop(0, 1, 0, n, True), Hop(1, 0, n, 2 * n, True)],
        [Hop(0, 1, n, 2 * n, False), Hop(1, 0, 0, n, False)],
    ]
    return Collective(reduction, reduction.targets, rounds, 100)


def update_of_g() -> Task:
    from legion_nn.ir import Requirement
    from legion_nn.privilege import Privilege

    read = Requirement("g", "gradient", Privilege.READ, Rect((0,), (1,)), None)
    return Task("update", "update", "update", (1,), {}, (read,), Rect((0,), (1,)))


def all_reduce_beneath(middle: float) -> tuple[dict[int, RankProgram], dict[int, list[float]]]:
    """Two ranks: a backward task starts a two-round all-reduce of 1 MB each way, a task
    computes `middle` seconds beneath it, and the update reads the sum."""
    collective = two_round_allreduce(1_000_000)
    programs = {
        rank: program(
            rank,
            [
                RankTask(0, task("backward"), collectives=[collective]),
                RankTask(1, task("below")),
                RankTask(2, update_of_g()),
            ],
        )
        for rank in (0, 1)
    }
    return programs, {rank: [0.0, middle, 0.0] for rank in (0, 1)}


@pytest.mark.parametrize("middle", [5.0, 0.2])
def test_a_collective_round_follows_only_when_the_rank_calls_into_mpi(middle):
    programs, compute = all_reduce_beneath(middle)
    step = simulate_step(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6 / 2))
    # a round is 1 MB each way at once (full duplex): 0.5 s. The first starts at 0; the second
    # is posted at the end of `below` if the first was done by then, else as it ends, since
    # the rank then waits in the update and polls.
    expected = max(middle, 0.5) + 0.5
    assert step.seconds == pytest.approx(expected)


def reads(tensor: str) -> Task:
    from legion_nn.ir import Requirement
    from legion_nn.privilege import Privilege

    read = Requirement(tensor, "input", Privilege.READ, Rect((0,), (1,)), None)
    return Task(f"reads {tensor}", "relu", "backward", (1,), {}, (read,), Rect((0,), (1,)))


@pytest.mark.parametrize("simulate", [simulate_step, simulate_compiled])
@pytest.mark.parametrize("in_start_order", [False, True])
def test_a_collective_completes_where_it_is_due_while_an_older_one_goes_on(
    simulate, in_start_order
):
    """A weight's two-round all-reduce (1 MB a hop, 0.5 s) starts at task 0; task 1 computes
    0.2 s and starts a one-round exchange of 1 kB on `h`, which task 2 reads (1 s of compute);
    the update reads the weight's sum. `h`'s hops queue behind the weight's first round, to
    0.5005, and the weight's second round goes out after them, to 1.0005. Due where it is
    read, `h` completes at 0.5005 and task 2 runs while the weight's round is on the wire:
    1.5005 s. Completed in start order, task 2 waited for the weight first: 2.0005."""
    weight = two_round_allreduce(1_000_000)
    n = 250
    reduction = Reduction("h", "allreduce", (0, 1), ((Rect((0,), (n,)), (0, 1)),), 4)
    exchange = Collective(
        reduction, reduction.targets, [[Hop(0, 1, 0, n, True), Hop(1, 0, 0, n, True)]], 200
    )
    before_h, before_update = ((0, 1), ()) if in_start_order else ((1,), (0,))
    programs = {
        rank: program(
            rank,
            [
                RankTask(0, task("backward"), collectives=[weight]),
                RankTask(1, task("below"), collectives=[exchange]),
                RankTask(2, reads("h"), complete_before=before_h),
                RankTask(3, update_of_g(), complete_before=before_update),
            ],
        )
        for rank in (0, 1)
    }
    compute = {rank: [0.0, 0.2, 1.0, 0.0] for rank in (0, 1)}
    step = simulate(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6 / 2))
    assert step.seconds == pytest.approx(2.0005 if in_start_order else 1.5005)


@pytest.mark.parametrize("simulate", [simulate_step, simulate_compiled])
@pytest.mark.parametrize("middle", [5.0, 0.2])
def test_the_network_stack_takes_cpu_from_a_kernel_only_while_both_run(middle, simulate):
    """The first round (1 MB each way, 0.5 s) is on the wire while `below` computes: each rank
    pays 100 ns of CPU a byte for the part of its two transfers that crosses while it computes.
    Over 5 s that is all 2 MB (0.2 s more); 0.2 s of compute take 0.2 / 0.6 s beside the round
    (`sharing_core`), and the rank then waits for the round anyway, so the step does not
    move."""
    programs, compute = all_reduce_beneath(middle)
    machine = Machine(memory_gbytes_per_s=None, network_cpu_ns_per_byte=100.0)
    step = simulate(programs, compute, machine, links(alpha=0.0, beta=1e-6 / 2))
    below = middle + 2e6 * 1e-7 if middle >= 0.5 else middle / 0.6
    assert step.seconds == pytest.approx(max(below, 0.5) + 0.5)
    quiet = simulate(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6 / 2))
    assert step.seconds - quiet.seconds == pytest.approx(0.2 if middle >= 0.5 else 0.0)


@pytest.mark.parametrize(
    "seconds, wire, expected",
    [
        # alone, or beside a transfer already over
        (0.2, [], 0.2),
        (0.2, [(-1.0, 0.0, 10**6)], 0.2),
        # 2 MB over [0, 0.5] at 100 ns a byte take 40% of the core: 0.2 s of compute end at
        # 0.2 / 0.6, by when a third of the bytes have crossed (not 0.2 + 40% of 0.2)
        (0.2, [(0.0, 0.5, 2 * 10**6)], 0.2 / 0.6),
        # all of them cross within the compute: 0.2 s more
        (5.0, [(0.0, 0.5, 2 * 10**6)], 5.2),
        # a transfer from 0.1 to 0.3 (half the core): 0.1 s at the full core, 0.1 at half
        (0.2, [(0.1, 0.3, 10**6)], 0.3),
        # 20 MB in 1 s would take twice the core: the kernel waits for them all
        (0.1, [(0.0, 1.0, 2 * 10**7)], 2.1),
        # no kernel: nothing to stretch
        (0.0, [(0.0, 0.5, 2 * 10**6)], 0.0),
    ],
)
def test_a_kernel_shares_its_core_with_the_bytes_crossing_meanwhile(seconds, wire, expected):
    assert sharing_core(seconds, 1e-7, wire) == pytest.approx(expected)


def test_a_kernel_beside_transfers_ends_at_the_first_time_its_work_and_theirs_are_done():
    """On random transfers, s = seconds + cpu × (bytes on the wire in [0, s]), and no earlier
    time satisfies it (the least solution, found on a fine grid)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        starts = rng.uniform(-0.5, 1.0, n)
        wire = [(a, a + rng.uniform(0.01, 1.0), int(rng.integers(1, 10**7))) for a in starts]
        seconds, cpu = rng.uniform(0.01, 1.0), 10 ** rng.uniform(-8.5, -6.5)

        def on_wire(s: float, wire=wire) -> float:
            return sum(n * max(min(b, s) - max(a, 0.0), 0.0) / (b - a) for a, b, n in wire)

        found = sharing_core(seconds, cpu, wire)
        assert found == pytest.approx(seconds + cpu * on_wire(found), rel=1e-9)
        earlier = np.linspace(0.0, found, 400)[:-1]
        assert all(s < seconds + cpu * on_wire(s) for s in earlier)


def copies(pairs: list[tuple[int, int]], nbytes: int, nranks: int) -> dict[int, RankProgram]:
    """Each (src, dst) copies `nbytes`, posted at the start, read by the second task."""
    sent = [Message(i, "x", Rect((0,), (1,)), s, d, nbytes, 1, 0, False) for i, (s, d) in
            enumerate(pairs)]  # fmt: skip

    def tasks(rank: int) -> list[RankTask]:
        mine = [m for m in sent if rank in (m.src, m.dst)]
        return [
            RankTask(0, task("a"), post=mine),
            RankTask(1, task("b"), copies_in=[m for m in mine if m.dst == rank]),
        ]

    return {rank: RankProgram(rank, nranks, tasks(rank), [], {}, 0, 0) for rank in range(nranks)}


def test_the_ranks_of_a_host_share_its_link_one_message_after_another():
    programs = copies([(0, 2), (1, 3)], 1_000_000, 4)
    compute = {rank: [0.0, 0.0] for rank in range(4)}
    step = simulate_step(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6, per_host=2))
    assert sorted(step.finish[r] for r in (2, 3)) == pytest.approx([1.0, 2.0])
    apart = simulate_step(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6, per_host=1))
    assert [apart.finish[r] for r in (2, 3)] == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("simulate", [simulate_step, simulate_compiled])
def test_a_sender_goes_on_to_other_peers_while_one_is_busy(simulate):
    """Rank 0's copy holds rank 2's ingress for [0, 1] s. Rank 1's copy to rank 2 leaves its
    egress over [0, 1] and waits in the switch for rank 2's ingress (arriving at 2 s); rank 1's
    copy to rank 3 leaves next, over [1, 2]. Were a sender's egress held until its queued copy
    arrived, rank 3 would wait until 3 s, and a many-to-many exchange on hundreds of ranks would
    convoy (vgg19's 512-rank auto plan simulated 1.31 s, 79% over its sum of 0.73 s; 0.75 s
    with the queue)."""
    programs = copies([(0, 2), (1, 2), (1, 3)], 1_000_000, 4)
    compute = {rank: [0.0, 0.0] for rank in range(4)}
    step = simulate(programs, compute, MACHINE, links(alpha=0.0, beta=1e-6))
    assert step.finish[3] == pytest.approx(2.0)
    assert step.finish[2] == pytest.approx(2.0)
    assert step.finish[1] == pytest.approx(2.0)  # its copy to rank 2 seen off when it arrives


def test_a_copy_within_a_host_takes_the_host_link_not_the_network():
    programs = copies([(0, 1), (1, 0)], 1_000_000, 2)
    compute = {rank: [0.0, 0.0] for rank in range(2)}
    step = simulate_step(programs, compute, MACHINE, links(beta=1e-6, per_host=2, beta_intra=1e-9))
    assert step.seconds == pytest.approx(1e-3)


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
def test_a_plan_step_lies_between_its_bounds(strategy):
    graph = load_network("seed-lcn-small").lower(batch=16, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, strategy, 3), 3)
    fast = Machine(link_gbytes_per_s=1e6, latency_us=1e-6)
    compute = compute_per_rank(graph, plan, fast)
    busiest = max(float(sum(per[rank] for per in compute)) for rank in range(3))
    free = predict_step(graph, plan, fast)
    # links that cost nothing leave each rank its compute, and the waits for the busiest
    assert busiest <= free.seconds <= sum(float(per.max()) for per in compute) + 1e-9
    slow = Machine(link_gbytes_per_s=0.01, latency_us=50)
    simulated = predict_step(graph, plan, slow)
    # no schedule beats the busiest host's bytes on its link, nor its compute
    programs = build_programs(graph, plan, slow, range(3))
    sent = max(prog.bytes_planned for prog in programs.values())
    assert simulated.seconds >= max(sent * slow.beta, busiest)


def test_each_end_of_a_message_costs_its_rank_the_message_overhead():
    """The copy of the first test, with 0.25 s per message end: the sender posts it 0.25 s
    after its compute, and the reader's receive is posted 0.25 s late too (off its path)."""
    m = Message(0, "x", Rect((0,), (1,)), 0, 1, 1_000_000, 1, 0, False)
    programs = {
        0: program(0, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"))]),
        1: program(1, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"), copies_in=[m])]),
    }
    compute = {0: [1.0, 1.0], 1: [0.5, 1.0]}
    machine = Machine(memory_gbytes_per_s=None, message_overhead_us=0.25e6)
    step = simulate_step(programs, compute, machine, links())
    assert step.finish[1] == pytest.approx(3.1 + 0.25)
    assert step.finish[0] == pytest.approx(2.1 + 0.25)


def test_ranks_sharing_a_core_pay_their_message_ends_twice_over():
    """The copy above between two ranks of one host with one core: each end's 0.25 s of
    bookkeeping takes 0.5 s (the cost was measured with a rank alone on its cores). The sender
    posts at 1.5, the copy takes 1.1 s within the host, and the reader waits for it until 2.6;
    both simulators agree."""
    m = Message(0, "x", Rect((0,), (1,)), 0, 1, 1_000_000, 1, 0, False)
    programs = {
        0: program(0, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"))]),
        1: program(1, [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"), copies_in=[m])]),
    }
    compute = {0: [1.0, 1.0], 1: [0.5, 1.0]}
    machine = Machine(
        memory_gbytes_per_s=None, message_overhead_us=0.25e6, ranks_per_host=2, host_cores=1
    )
    one_host = links(per_host=2, alpha_intra=0.1, beta_intra=1e-6)
    for simulate in (simulate_step, simulate_compiled):
        step = simulate(programs, compute, machine, one_host)
        assert step.finish[1] == pytest.approx(3.6)
        assert step.finish[0] == pytest.approx(2.6)  # its send seen off


def test_a_collective_hop_costs_each_of_its_ranks_the_message_overhead():
    """Each round of the two-round all-reduce has a send and a receive on each rank: two
    message ends, 2h a round, both rounds on the path when the task between them is long."""
    collective = two_round_allreduce(1_000_000)
    programs = {
        rank: program(rank, [RankTask(0, task("backward"), collectives=[collective]),
                             RankTask(1, task("below")), RankTask(2, update_of_g())])
        for rank in (0, 1)
    }  # fmt: skip
    compute = {rank: [0.0, 5.0, 0.0] for rank in (0, 1)}
    h = 0.01
    machine = Machine(memory_gbytes_per_s=None, message_overhead_us=h * 1e6)
    step = simulate_step(programs, compute, machine, links(alpha=0.0, beta=1e-6 / 2))
    assert step.seconds == pytest.approx(5.5 + 4 * h)


def test_the_simulated_step_runs_the_tasks_the_runtime_runs():
    """One rank: each zeroing the first contribution overwrites is elided, each update fused
    into its gradient's kernel adds its time there (less the task overhead it no longer pays);
    a step of tasks of 1 s each is 1 s for every task that runs, and the fused updates' seconds
    less their overhead."""
    graph = load_network("seed-lcn-small").lower(batch=4, optimizer="sgd")
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    machine = Machine(task_overhead_us=0.1e6)
    (program_0,) = build_programs(graph, plan, machine, [0]).values()
    elided = [rt for rt in program_0.tasks if rt.elided]
    fused = [rt for rt in program_0.tasks if rt.fused_into is not None]
    assert elided and fused
    ones = [[1.0] for _ in graph.tasks]
    step = predict_step(graph, plan, machine, ones)
    runs = len(program_0.tasks) - len(elided) - len(fused)
    assert step.seconds == pytest.approx(runs + len(fused) * 0.9)


def test_a_host_whose_stack_serves_both_ways_sends_and_receives_at_the_duplex_rate():
    """Two hosts copy 1 MB to each other at once over a 1 us/byte link. Full duplex, both take
    1 s. Where the stack moves both ways at 0.75 us a byte in all (1.5 us/byte each way: the
    duplex rate is two thirds of one way's), the exchange takes 1.5 s, as the duplex rate says
    (it took 1.75 s when the second copy waited for both stacks before taking the link: every
    ring round between two such hosts was priced 17% slower than `bench machine` measured
    it). Half duplex from 0.5 us a byte (2 us each way): 2 s. A lone copy still takes 1 s: the
    stack is faster than the link one way; two one way back to back, 2 s."""
    both = copies([(0, 1), (1, 0)], 1_000_000, 2)
    zero = {r: [0.0, 0.0] for r in range(2)}
    for simulate in (simulate_step, simulate_compiled):
        full = simulate(both, zero, MACHINE, links(alpha=0.0))
        assert [full.finish[r] for r in (0, 1)] == pytest.approx([1.0, 1.0])
        for stack_beta, exchange in ((0.75e-6, 1.5), (1e-6, 2.0)):
            stacked = Links(0.0, 1e-6, 0.0, 1e-9, 1, stack_beta=stack_beta)
            shared = simulate(both, zero, MACHINE, stacked)
            assert sorted(shared.finish.values()) == pytest.approx([exchange, exchange])
        alone = simulate(copies([(0, 1)], 1_000_000, 2), zero, MACHINE, stacked)
        assert alone.finish[1] == pytest.approx(1.0)
        one_way = simulate(copies([(0, 1), (0, 1)], 1_000_000, 2), zero, MACHINE, stacked)
        assert one_way.finish[1] == pytest.approx(2.0)


def test_an_exchange_between_hosts_takes_the_time_bench_machine_measured_for_its_size():
    """A machine file's exchanges timed by size (`duplex` ping-pongs): two hosts copying 16 or
    64 MiB to each other at once finish at the measured exchange's time, in both simulators,
    whatever the one-way curve (here faster each way than half an exchange)."""
    one_way = [(8, 1e-5), (1 << 20, 1.5e-3), (16 << 20, 0.028), (64 << 20, 0.125)]
    duplex = [(1 << 20, 3e-3), (16 << 20, 0.037), (64 << 20, 0.24)]
    machine = Machine(
        link_gbytes_per_s=0.55, latency_us=10.0, duplex_gbytes_per_s=0.27,
        memory_gbytes_per_s=None,
        link_curves={"inter_host": tuple(one_way), "duplex": tuple(duplex)},
    )  # fmt: skip
    links = Links.of(machine, 2)
    for nbytes, measured in duplex[1:]:
        both = copies([(0, 1), (1, 0)], nbytes, 2)
        zero = {r: [0.0, 0.0] for r in range(2)}
        for simulate in (simulate_step, simulate_compiled):
            step = simulate(both, zero, machine, links)
            assert sorted(step.finish.values()) == pytest.approx([measured, measured], rel=1e-9)


def test_the_stack_rate_comes_from_the_duplex_rate_and_never_binds_one_way():
    link = {"link_gbytes_per_s": 1.0, "memory_gbytes_per_s": None}
    assert Machine(**link).stack_beta == 0.0
    assert Machine(**link, duplex_gbytes_per_s=1.2).stack_beta == 0.0  # full duplex
    # within the fits' spread of the one-way rate: full duplex too
    assert Machine(**link, duplex_gbytes_per_s=0.996).stack_beta == 0.0
    assert Machine(**link, duplex_gbytes_per_s=0.9).stack_beta > 0.0
    half = Machine(**link, duplex_gbytes_per_s=0.5)  # half duplex: 1 GB/s in all
    assert half.stack_beta == pytest.approx(1e-9)
    assert half.ring_beta == pytest.approx(2e-9)
    assert Machine(**link, duplex_gbytes_per_s=0.25).stack_beta == pytest.approx(1e-9)
    # the bulk sum: a rank that sends and receives 1 GB at once pays 2 s on the half-duplex
    # host, 1 s on a full-duplex one, and a rank that only sends pays 1 s on either
    gb = np.array([1e9])
    one = np.array([1])  # one message: its latency too
    assert loads_time(gb, gb, one, half) == pytest.approx(2.0 + half.alpha)
    assert loads_time(gb, gb, one, Machine(**link)) == pytest.approx(1.0 + half.alpha)
    assert loads_time(gb, np.array([0.0]), one, half) == pytest.approx(1.0 + half.alpha)


def test_an_idle_link_lets_its_burst_through_at_once_and_refills_at_its_rate():
    """A 1 MB burst, 1 us a byte: a lone 0.6 MB copy takes the latency alone; two of them back
    to back drain the bucket, so the second pays for the 0.2 MB the burst no longer covers."""
    burst = Links(0.1, 1e-6, 0.0, 1e-9, 1, burst=1_000_000)
    one = copies([(0, 1)], 600_000, 2)
    step = simulate_step(one, {r: [0.0, 0.0] for r in range(2)}, MACHINE, burst)
    assert step.finish[1] == pytest.approx(0.1)
    two = copies([(0, 1), (0, 1)], 600_000, 2)
    step = simulate_step(two, {r: [0.0, 0.0] for r in range(2)}, MACHINE, burst)
    assert step.finish[1] == pytest.approx(0.1 + 0.1 + 0.2)
    # without a burst, each pays its bytes
    plain = simulate_step(two, {r: [0.0, 0.0] for r in range(2)}, MACHINE, links())
    assert plain.finish[1] == pytest.approx(2 * (0.1 + 0.6))


def test_a_burst_refills_while_the_link_is_idle():
    """The second copy is posted 0.45 s after the first ended: 0.45 MB of tokens are back."""
    sent = [Message(i, "x", Rect((0,), (1,)), 0, 1, 600_000, 1, 0, False) for i in range(2)]
    tasks = {
        rank: [RankTask(0, task("a"), post=[sent[0]]), RankTask(1, task("b"), post=[sent[1]],
               copies_in=[sent[0]] if rank == 1 else []),
               RankTask(2, task("c"), copies_in=[sent[1]] if rank == 1 else [])]
        for rank in (0, 1)
    }  # fmt: skip
    programs = {rank: program(rank, tasks[rank]) for rank in (0, 1)}
    compute = {0: [0.0, 0.55, 0.0], 1: [0.0, 0.0, 0.0]}
    burst = Links(0.1, 1e-6, 0.0, 1e-9, 1, burst=1_000_000)
    step = simulate_step(programs, compute, MACHINE, burst)
    # the first ends at 0.1 with 0.4 MB left; the second starts at 0.55: 0.4 + 0.45 = 0.85 MB
    assert step.finish[1] == pytest.approx(0.55 + 0.1)


def _held_programs(tasks_0: list[RankTask], tasks_1: list[RankTask]) -> dict[int, RankProgram]:
    return {0: program(0, tasks_0), 1: program(1, tasks_1)}


def _message(seq: int) -> Message:
    return Message(seq, "x", Rect((0,), (1,)), 0, 1, 1_000_000, 1, 0, False)


def test_a_message_between_hosts_moves_at_the_computing_rate_while_a_kernel_runs_where_it_goes():
    """MPI takes a message in over TCP only when its rank calls into it, which a rank in a
    kernel leaves to its progress thread (`Machine.computing_gbytes_per_s`). A 1 MB message on
    a 1 us/byte link takes 1 s alone; held to 0.25 MB/s while its receiver's kernel of 0.5 s
    runs, it moves a quarter as fast meanwhile, then at the link's rate again, in both
    simulators:

    - posted by the receiver at 0.2 s, before its kernel from 0.2 to 0.7: 0.125 s of its bytes
      cross in the kernel, so it ends at 0.7 + (1 - 0.125) = 1.575 s (put back after it was
      scheduled, while its sender waits to see it off);
    - posted by the sender at 0.3 s, in the receiver's kernel from 0 to 0.5: 0.05 s of its
      bytes cross by 0.5 s, so it ends at 0.5 + (1 - 0.05) = 1.45 s (held as it is scheduled);
    - a kernel at its sender holds nothing back.

    The receiver reads it in a task of 0.1 s."""
    m = _message(0)
    free = links(alpha=0.0)
    held = Links(0.0, 1e-6, 0.0, 1e-9, 1, computing_rate=250_000.0)
    fast = Links(0.0, 1e-6, 0.0, 1e-9, 1, computing_rate=2e6)  # above the message's own rate
    first = _held_programs(
        [RankTask(0, task("a"), post=[m])],
        [RankTask(0, task("a"), post=[m]), RankTask(1, task("b")),
         RankTask(2, task("c"), copies_in=[m])],
    )  # fmt: skip
    receiving = {0: [0.0], 1: [0.2, 0.5, 0.1]}
    sending = {0: [0.3], 1: [0.0, 0.5, 0.1]}
    at_sender = _held_programs(
        [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"))],
        [RankTask(0, task("a"), post=[m]), RankTask(1, task("b"), copies_in=[m])],
    )
    for simulate in (simulate_step, simulate_compiled):
        assert simulate(first, receiving, MACHINE, free).finish[1] == pytest.approx(1.2 + 0.1)
        step = simulate(first, receiving, MACHINE, held)
        assert step.finish[1] == pytest.approx(1.575 + 0.1)
        assert step.finish[0] == pytest.approx(1.575)  # its send seen off
        assert simulate(first, receiving, MACHINE, fast).finish[1] == pytest.approx(1.3)
        assert simulate(first, sending, MACHINE, free).finish[1] == pytest.approx(1.3 + 0.1)
        assert simulate(first, sending, MACHINE, held).finish[1] == pytest.approx(1.45 + 0.1)
        kernel_at_sender = {0: [0.0, 0.5], 1: [0.0, 0.1]}
        assert simulate(at_sender, kernel_at_sender, MACHINE, held).finish[1] == pytest.approx(1.1)
        # unless the machine holds what a kernel's rank sends too: 0.125 s of its bytes cross
        # by 0.5 s, so it ends at 0.5 + 0.875 = 1.375 s
        sends_held = replace(held, computing_rate=0.0, computing_send_rate=250_000.0)
        step = simulate(at_sender, kernel_at_sender, MACHINE, sends_held)
        assert step.finish[1] == pytest.approx(1.375 + 0.1)
        # what the progress thread moves in one call crosses first at the link's speed: with
        # 0.25 MB of it, held from 0.45 s to 0.7 s, 0.0625 s of its bytes cross meanwhile, so it
        # ends at 0.7 + (1.2 - 0.45 - 0.0625) = 1.3875 s; with the whole 1 MB, not at all
        for at_once, ends in ((250_000.0, 1.3875), (1_000_000.0, 1.2)):
            buffered = replace(held, progress_s=at_once / held.computing_rate)
            step = simulate(first, receiving, MACHINE, buffered)
            assert step.finish[1] == pytest.approx(ends + 0.1)


def _passes(after_copies: list[float], after_compute: list[float]) -> TaskPasses:
    n = len(after_copies)
    return TaskPasses(0.0, [0.0] * n, after_copies, after_compute, [0.0] * n, [0.0] * n)


def test_a_ranks_passes_around_its_kernel_hold_its_messages_and_share_its_core_as_the_kernel():
    """The runtime packs, unpacks, fills windows and zeroes with its progress thread on, as it
    runs its kernels (`RankStep.task`), so the simulators stretch and hold a task's passes and
    its compute as one. The first case of the test above with the receiver's 0.5 s task made of
    0.1 s unpacking, a 0.3 s kernel and 0.1 s packing ends as that one does (1.575 + 0.1 s; held
    in the kernel alone, 1.425 + 0.1), of which its kernel took 0.3 s. With the network stack
    taking 0.5 us of the core a byte (the message unheld, 0.2 s to 1.2 s), a task of 0.2 s
    unpacking, a 0.6 s kernel and 0.2 s packing from 0.2 s takes s = 1 + 0.5 × 1 = 1.5 s, the
    kernel 0.9 s of it (stretched in the kernel alone, 0.2 + 1.0 + 0.2 = 1.4 s)."""
    m = _message(0)
    programs = _held_programs(
        [RankTask(0, task("a"), post=[m])],
        [RankTask(0, task("a"), post=[m]), RankTask(1, task("b")),
         RankTask(2, task("c"), copies_in=[m])],
    )  # fmt: skip
    held = Links(0.0, 1e-6, 0.0, 1e-9, 1, computing_rate=250_000.0)
    stack = Machine(memory_gbytes_per_s=None, network_cpu_ns_per_byte=500.0)
    for simulate in (simulate_step, simulate_compiled):
        passes = {0: _passes([0.0], [0.0]), 1: _passes([0.0, 0.1, 0.0], [0.0, 0.1, 0.0])}
        compute = {0: [0.0], 1: [0.2, 0.3, 0.1]}
        step = simulate(programs, compute, MACHINE, held, passes)
        assert step.finish[1] == pytest.approx(1.575 + 0.1)
        assert step.compute[1] == pytest.approx(0.2 + 0.3 + 0.1)
        passes = {0: _passes([0.0], [0.0]), 1: _passes([0.0, 0.2, 0.0], [0.0, 0.2, 0.0])}
        compute = {0: [0.0], 1: [0.2, 0.6, 0.1]}
        step = simulate(programs, compute, stack, links(alpha=0.0), passes)
        assert step.finish[1] == pytest.approx(0.2 + 1.5 + 0.1)
        assert step.compute[1] == pytest.approx(0.2 + 0.9 + 0.1)


def test_what_follows_a_held_message_on_its_link_waits_for_it():
    """Two 1 MB messages from host 0 to host 1 on a 1 us/byte link, the first held to a
    quarter of its speed by a kernel of 0.4 s at its receiver: the second, posted at 0.5 s,
    leaves when the first is through (1.3 s), and ends at 2.3 s."""
    first, second = _message(0), _message(1)
    programs = _held_programs(
        [RankTask(0, task("a"), post=[first]), RankTask(1, task("b"), post=[second])],
        [RankTask(0, task("a"), post=[first, second]), RankTask(1, task("b")),
         RankTask(2, task("c"), copies_in=[first, second])],
    )  # fmt: skip
    compute = {0: [0.0, 0.5], 1: [0.0, 0.4, 0.0]}
    held = Links(0.0, 1e-6, 0.0, 1e-9, 1, computing_rate=250_000.0)
    for simulate in (simulate_step, simulate_compiled):
        # the first crosses 0.1 s of its bytes in the kernel and ends at 0.4 + 0.9 = 1.3 s
        assert simulate(programs, compute, MACHINE, held).finish[1] == pytest.approx(2.3)
        # unheld, the second leaves at 1.0 s
        unheld = simulate(programs, compute, MACHINE, links(alpha=0.0))
        assert unheld.finish[1] == pytest.approx(2.0)
