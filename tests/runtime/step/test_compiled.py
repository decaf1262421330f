"""The compiled step loop (`runtime.step.compiled`) against the step simulator it stands for.

`StepModel.step_prediction` runs every plan's step through the compiled loop; `runtime.step.simulator`
states the model in Python. The two must give the same step, float-equal (the same sums in the
same order), on every kind of plan: data, model, spatial and auto, replicated and sharded homes,
1 to 8 ranks, one rank per host and two (whose messages within a host take the host's own
link), with memory traffic and a per-message overhead priced (so that packing, adding and each
hop's overhead are all in the clocks), with a link's burst, with links priced by the measured
times of messages of each size, with the network stack's CPU and ranks sharing a core, and with
messages held back while kernels run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from legion_nn.micro_batches import micro_batched
from legion_nn.sources import load_source_graph
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from runtime.step import model as model_module
from runtime.step import prediction
from runtime.step.model import StepModel
from runtime.step.prediction import predict_step, simulate_compiled
from runtime.step.programs import build_programs
from runtime.step.simulator import simulate_step
from tests.paths import FIXTURES, ROOT

EXAMPLES = ROOT / "examples"

#: a slow link, so that messages and collectives shape the step, with memory traffic and a
#: per-message cost priced
PRICED = {"link_gbytes_per_s": 0.5, "latency_us": 20.0, "memory_gbytes_per_s": 10.0,
          "message_overhead_us": 3.0, "task_overhead_us": 5.0}  # fmt: skip


def _curve(latency_us: float, rates: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """Ping-pong points of a link whose messages of each size run at `rates[size]` GB/s."""
    return ((8, latency_us * 1e-6),) + tuple(
        (size, latency_us * 1e-6 + size / (gbytes * 1e9)) for size, gbytes in rates.items()
    )


#: a software link's measured times: messages that stay in cache cross faster than large ones
CURVES = {
    "inter_host": _curve(20.0, {1 << 16: 1.5, 1 << 20: 1.2, 1 << 24: 0.5}),
    "intra_host": _curve(1.0, {1 << 16: 3.0, 1 << 20: 8.0}),
}
MACHINES = {
    "one-per-host": Machine(**PRICED),
    # within a host and between hosts, messages priced by the measured times of their sizes
    "two-per-host": Machine(**PRICED, ranks_per_host=2, intra_host=(1.0, 8.0), link_curves=CURVES),
    # a link that lets 64 KB through at once when idle (`link_burst_bytes`), and the runtime's
    # own passes over its buffers timed (`local_passes`) rather than priced as memory traffic
    "bursting": Machine(
        **PRICED,
        ranks_per_host=2,
        link_burst_bytes=65536.0,
        buffer_gbytes_per_s={"copy": 6.0, "add": 4.0, "zero": 9.0},
    ),
    # a network stack that takes CPU from the kernels it runs beside, and two ranks a host on
    # one core, whose CPU work all takes twice as long (a third rank has its host to itself)
    "stack-cpu-shared-core": Machine(
        **PRICED, ranks_per_host=2, network_cpu_ns_per_byte=2.0, host_cores=1
    ),
    # a half-duplex software link priced by its measured times, its stack at their rates
    "half-duplex-measured": Machine(
        **PRICED, duplex_gbytes_per_s=0.3, network_cpu_ns_per_byte=1.0, link_curves=CURVES
    ),
    # a software link whose hosts' stacks move both ways at 0.3 GB/s each (0.5 alone), with a
    # burst
    "half-duplex": Machine(
        **PRICED, duplex_gbytes_per_s=0.3, link_burst_bytes=65536.0, network_cpu_ns_per_byte=1.0
    ),
    # messages between hosts held to 5 MB/s while a kernel runs where they go and 8 MB/s where
    # they leave (the progress thread's cadence: 50 and 80 KB a call), on a half-duplex link
    # whose stack takes CPU from the kernels
    "held-by-kernels": Machine(
        **PRICED,
        ranks_per_host=2,
        duplex_gbytes_per_s=0.3,
        network_cpu_ns_per_byte=1.0,
        computing_gbytes_per_s=0.005,
        computing_send_gbytes_per_s=0.008,
        link_burst_bytes=65536.0,
    ),
}

#: (network, batch, strategies, homes)
NETWORKS = [
    ("seed-lcn-small", 8, ("data", "model", "spatial", "auto"), ("replicated", "sharded")),
    ("seed-lcn", 8, ("data", "spatial", "auto"), ("replicated",)),
    (str(EXAMPLES / "megatron-mlp.json"), 8,
     ("data", "model", "auto", str(EXAMPLES / "megatron-col-row-2.json")), ("replicated", "sharded")),
    (str(FIXTURES / "mlp_small.json"), 8, ("data", "model", "auto"), ("replicated", "sharded")),
    (str(FIXTURES / "residual_small.json"), 8, ("data", "model", "spatial", "auto"),
     ("replicated", "sharded")),
    (str(FIXTURES / "digits_cnn.onnx"), 8, ("data", "model", "spatial", "auto"), ("replicated",)),
]  # fmt: skip
RANKS = (1, 2, 3, 8)


def _cases():
    for network, batch, strategies, homes in NETWORKS:
        for strategy in strategies:
            for home in homes:
                for ranks in RANKS:
                    if strategy.endswith("-2.json") and ranks != 2:
                        continue  # a strategy file for 2 ranks
                    name = Path(network).stem
                    label = f"{name}-{Path(strategy).stem}-{home}-{ranks}"
                    yield pytest.param(network, batch, strategy, home, ranks, id=label)


def _plan(
    network: str,
    batch: int,
    strategy: str,
    home: str,
    ranks: int,
    machine: Machine,
    micro_batches: int = 1,
    schedule: str = "1f1b",
):
    graph = micro_batched(load_source_graph(network, batch, batch), micro_batches, schedule)
    chosen, _ = resolve_strategy(graph, strategy, ranks, machine, 5.0, None, home)
    return graph, build_plan(graph, chosen, ranks)


@pytest.mark.parametrize("network, batch, strategy, home, ranks", list(_cases()))
def test_the_compiled_loop_gives_the_simulators_step(network, batch, strategy, home, ranks):
    # auto's grids are chosen once, for the first machine: the loop's step is compared on each
    # machine for the same plans (choosing them again per machine cost most of the test)
    graph, plan = _plan(network, batch, strategy, home, ranks, next(iter(MACHINES.values())))
    for name, machine in MACHINES.items():
        programs = build_programs(graph, plan, machine, range(ranks))
        exact = predict_step(graph, plan, machine, programs=programs, simulate=simulate_step)
        fast = predict_step(graph, plan, machine, programs=programs, simulate=simulate_compiled)
        assert fast.seconds == exact.seconds, name
        assert fast.finish == exact.finish, name
        assert fast.waiting == exact.waiting, name
        assert fast.compute == exact.compute, name


@pytest.mark.parametrize("strategy", ["data", "model", "spatial", "auto"])
@pytest.mark.parametrize(("ranks", "micro_batches", "schedule"), [(2, 2, "1f1b"), (4, 4, "gpipe")])
def test_the_compiled_loop_gives_the_simulators_step_of_micro_batches(
    strategy, ranks, micro_batches, schedule
):
    """Micro-batches interleave forwards and backwards and defer gradients' sums to the last
    (`partitioner.deferred_sums`): both simulators run the same step."""
    for name, machine in MACHINES.items():
        graph, plan = _plan(
            "seed-lcn-small", 8, strategy, "replicated", ranks, machine, micro_batches, schedule
        )
        programs = build_programs(graph, plan, machine, range(ranks))
        exact = predict_step(graph, plan, machine, programs=programs, simulate=simulate_step)
        fast = predict_step(graph, plan, machine, programs=programs, simulate=simulate_compiled)
        assert (fast.seconds, fast.finish, fast.waiting, fast.compute) == (
            exact.seconds, exact.finish, exact.waiting, exact.compute
        ), name  # fmt: skip


def test_the_cases_exercise_what_the_loop_models():
    """The cases above move copies, partial sums and collectives on slow links: a data plan of
    seed-lcn on 4 ranks waits for its all-reduces, and two ranks per host change the step."""
    steps = {}
    for name, machine in MACHINES.items():
        graph, plan = _plan("seed-lcn-small", 8, "data", "replicated", 4, machine)
        programs = build_programs(graph, plan, machine, range(4))
        assert any(rt.collectives for rt in programs[0].tasks)
        steps[name] = predict_step(graph, plan, machine, programs=programs)
        assert max(steps[name].waiting.values()) > 0
    assert steps["one-per-host"].seconds != steps["two-per-host"].seconds
    assert steps["stack-cpu-shared-core"].seconds > steps["two-per-host"].seconds
    assert steps["half-duplex"].seconds > steps["one-per-host"].seconds
    # held back while the kernels run, the all-reduces end later: on 6 ranks, whose
    # halving-doubling folds two of them in over the link while the others compute (on 4, its
    # exchanges between hosts come after the kernels)
    held = MACHINES["held-by-kernels"]
    unheld = replace(held, computing_gbytes_per_s=None, computing_send_gbytes_per_s=None)
    graph, plan = _plan("seed-lcn-small", 8, "data", "replicated", 6, unheld)
    rounds = {len(c.rounds) for rt in build_programs(graph, plan, held, [0])[0].tasks
              for c in rt.collectives}  # fmt: skip
    assert 2 + 2 * 2 in rounds  # folded, halved twice, doubled twice, unfolded
    six = [
        predict_step(graph, plan, machine, programs=build_programs(graph, plan, machine, range(6)))
        for machine in (held, unheld)
    ]
    assert six[0].seconds > six[1].seconds
    # the measured times price the messages: the same links at their fitted rates differ
    for name in ("two-per-host", "half-duplex-measured"):
        fitted = replace(MACHINES[name], link_curves={})
        graph, plan = _plan("seed-lcn-small", 8, "data", "replicated", 4, fitted)
        programs = build_programs(graph, plan, fitted, range(4))
        assert predict_step(graph, plan, fitted, programs=programs).seconds != steps[name].seconds


def test_step_prediction_simulates_at_every_rank_count():
    """No bulk-synchronous fallback: 72 ranks (beyond the 64 the simulation once stopped at)
    are simulated, and the sum is reported beside. (The compiled loop is held to the Python
    simulator above; on 72 ranks that simulator takes seconds.)"""
    machine = MACHINES["one-per-host"]
    graph, plan = _plan("seed-lcn-small", 72, "data", "replicated", 72, machine)
    bulk = plan_cost(graph, plan, machine).step_seconds
    step = StepModel(machine).step_prediction(graph, plan, bulk)
    assert step["step_model"] == "simulated"
    assert step["bulk_synchronous_seconds"] == bulk
    simulated = predict_step(graph, plan, machine, simulate=simulate_compiled)
    assert step["predicted_step_seconds"] == simulated.seconds != bulk


def test_the_budgets_count_each_participants_rounds_of_every_collective(monkeypatch):
    """The compiled loop steps every participant of a collective round by round, whatever its
    hops carry: the budgets count p·⌈log2 p⌉ a collective beside the messages. Deep-mlp's and
    vgg19's model plans on 2048 ranks (their layers' inputs all-gathered, vgg19's classifier's
    input gradient one reduce-scatter whose extra participants get their sums from partners,
    where 1,048 reduces over 1,001 ranks had taken 231 s to simulate) are within; a budget
    that their messages alone fit is not enough."""
    from legion_nn.networks import load_network
    from partitioner.strategy import builtin

    budget = model_module.simulation_budget(2048)
    for network, batch in (("deep-mlp", 128), ("vgg19", 64)):
        graph = load_network(network).lower(batch=batch)
        plan = build_plan(graph, builtin(graph, "model", 2048), 2048)
        messages = sum(len(b.dsts) for tp in plan.tasks for b in tp.transfer_set.blocks)
        rounds = sum(
            len(c.participants) * math.ceil(math.log2(max(len(c.participants), 2)))
            for tp in plan.tasks
            for c in [gather for _, gather in tp.gathered] + list(tp.reductions)
        )
        work = prediction.MESSAGE_WORK * (messages + rounds)
        assert prediction.message_work(plan) == pytest.approx(work, rel=1e-12)
        assert prediction.builds_on_budget(graph, plan, budget), network
        within_messages = prediction.MESSAGE_WORK * messages * 1.01
        assert within_messages < work
        monkeypatch.setattr(prediction, "SIMULATE_EVERY_RANK_MAX_WORK", within_messages)
        assert not prediction.builds_on_budget(graph, plan, budget), network
        monkeypatch.undo()


def test_a_step_past_the_budget_by_its_messages_alone_is_summed_untold(monkeypatch):
    """Telling ranks apart makes every rank's messages: where those alone are past the
    every-rank budget, and the ranks' programs are past the work a simulation builds, the step
    is summed without a program built (deep-mlp's model plan on 2048 ranks spent 17 s and 5.9
    GB on them before); where every rank's program is within that work, they are built and
    simulated all the same; `--simulate` still tells them apart."""
    machine = MACHINES["one-per-host"]
    graph, plan = _plan("deep-mlp", 72, "model", "replicated", 72, machine)
    built = []

    def counted(*args, **kwargs):
        built.append(args[1])
        return build_programs(*args, **kwargs)

    monkeypatch.setattr(model_module, "build_programs", counted)
    budget = model_module.simulation_budget(plan.nranks)
    assert prediction.builds_on_budget(graph, plan, budget)  # within both budgets as they stand
    monkeypatch.setattr(
        prediction, "SIMULATE_EVERY_RANK_MAX_WORK", prediction.message_work(plan) * 0.99
    )
    bulk = plan_cost(graph, plan, machine).step_seconds
    # every rank's program within the work a simulation builds: built, whatever its messages
    assert plan.nranks * len(graph.tasks) <= budget
    assert prediction.builds_on_budget(graph, plan, budget)
    step = StepModel(machine).step_prediction(graph, plan, bulk)
    assert step["step_model"] == "simulated" and built == [plan]
    built.clear()
    # past it too: summed, nothing built
    budget = plan.nranks * len(graph.tasks) - 1
    monkeypatch.setattr(model_module, "SIMULATE_MAX_WORK", budget)
    assert not prediction.builds_on_budget(graph, plan, budget)
    step = StepModel(machine).step_prediction(graph, plan, bulk)
    assert step["step_model"] == "bulk-synchronous" and not built
    StepModel(machine, simulate_any_size=True).programs(
        graph, plan, model_module.simulation_budget(plan.nranks)
    )
    assert built == [plan]


@pytest.mark.parametrize(
    ("network", "strategy", "ranks"),
    [
        ("seed-lcn-small", "model", 6),
        ("seed-lcn-small", "spatial", 8),
        ("deep-mlp", "model", 4),
    ],
)
def test_the_messages_facts_told_are_those_of_the_messages_posted(network, strategy, ranks):
    """Flattening programs built with the facts of the messages told them (`BuiltPrograms`,
    `SharedPrograms`) gives each message some ranks post the sequence number, ends and bytes
    that flattening the same programs read off their messages gives, each message once."""
    import numpy as np

    from runtime.step.compiled import flat_part
    from runtime.step.local_passes import PassPrices, passes_alone
    from runtime.step.shared_programs import facts_of_programs

    machine = MACHINES["two-per-host"]
    graph = load_source_graph(network, 8, 8)
    plan = build_plan(graph, resolve_strategy(graph, strategy, ranks, machine, 5.0)[0], ranks)
    for some in (list(range(ranks)), list(range(1, ranks, 2))):
        programs = build_programs(graph, plan, machine, some)
        assert facts_of_programs(programs) is not None
        by_hand = {rank: programs[rank] for rank in some}  # a plain mapping: no facts
        assert facts_of_programs(by_hand) is None
        compute = {rank: [1e-3] * len(programs[rank].tasks) for rank in some}
        passes = passes_alone(by_hand, PassPrices.of(machine))
        slowdown = dict.fromkeys(some, 1.0)
        told = flat_part(programs, compute, passes, slowdown)
        read = flat_part(by_hand, compute, passes, slowdown)

        def facts(part):
            rows = np.column_stack((part.seqs, part.src, part.dst, part.nbytes))
            return np.unique(rows, axis=0)

        assert len(facts(told)) == len(told.seqs)  # each message once
        assert np.array_equal(facts(told), facts(read))
        assert len(read.seqs)  # the plan moves messages
        assert np.array_equal(told.ops, read.ops) and np.array_equal(told.keys, read.keys)
