"""A plan's predicted step: every rank's program built, its tasks priced, and the step
simulated (`runtime.step.simulator` states the rules; `runtime.step.compiled` runs them over
flat arrays), or, where its programs would take more to build than `SIMULATE_MAX_WORK` (one per
class of ranks alike) and `SIMULATE_EVERY_RANK_MAX_WORK` (every rank's, in shares) allow, the
cost model's bulk-synchronous sum.

`partition`, `bench` and `auto` ask for predictions through `runtime.step.model.StepModel`,
which keeps each plan's programs and simulation; the functions here make one prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.micro_batches import schedule_of, stages_of
from partitioner.cost import compute_per_rank
from partitioner.machine import Machine
from partitioner.plan import Plan
from partitioner.task_plan import Reduction
from runtime.instances import choose_storage_orders
from runtime.step.links import Links
from runtime.step.local_passes import PassPrices, TaskPasses, passes_alone, task_passes
from runtime.step.piece_modes import moded_times, program_seconds
from runtime.step.programs import build_programs
from runtime.step.rank_cpu import cpu_slowdown
from runtime.step.rank_parts import has_part, idle_ranks
from runtime.step.rank_program import RankProgram
from runtime.step.shared_programs import source
from runtime.step.simulated_step import SimulatedStep
from runtime.step.simulator import simulate_step

if TYPE_CHECKING:
    from runtime.step.flat_step import FlatStep


def predict_step(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    compute: Sequence[Sequence[float]] | None = None,
    programs: Mapping[int, RankProgram] | None = None,
    simulate=simulate_step,
) -> SimulatedStep:
    """The simulated step of `plan`: `compute[i][rank]` seconds for task i of the graph on
    each rank (default: the cost model's, `cost.compute_per_rank`), every rank's program
    (`programs`, default: built here) run by `simulate` (`simulate_step`, or the compiled loop
    `simulate_compiled`, which returns the same step)."""
    per_task = compute if compute is not None else compute_per_rank(graph, plan, machine)
    if programs is None:
        programs = build_programs(graph, plan, machine, range(plan.nranks))
    table = np.asarray(per_task, np.float64).reshape(len(graph.tasks), plan.nranks)
    seconds, passes = priced(graph, plan, machine, programs, table)
    return simulate(programs, seconds, machine, passes=passes)


def priced(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    programs: Mapping[int, RankProgram],
    table: np.ndarray,
) -> tuple[dict[int, list[float]], dict[int, TaskPasses]]:
    """Per rank of `programs`, the seconds of its tasks (`table[i, rank]` for task i of the
    graph, in the mode each runs in here: `piece_modes`) and its own passes around them
    (`local_passes.task_passes`)."""
    index = {task.name: i for i, task in enumerate(graph.tasks)}
    share = machine.core_share(plan.nranks)
    prices, layouts = PassPrices.of(machine), choose_storage_orders(graph)
    #: per program (held, so that its id is its own), its tasks' rows of `table`, its tasks
    #: timed in a mode and its own passes around them: the ranks of a class share their source's
    moded: dict[int, tuple[RankProgram, np.ndarray, dict[int, float], TaskPasses]] = {}
    seconds, passes = {}, {}
    for rank in programs:
        program = source(programs, rank)  # a rank moved from another runs its tasks
        if id(program) not in moded:
            rows = np.array([index[rt.task.name] for rt in program.tasks], np.int64)
            own = task_passes(program, program.rank, prices, graph, layouts)
            moded[id(program)] = (program, rows, moded_times(program, machine.pieces), own)
        _, rows, times, passes[rank] = moded[id(program)]
        row = table[rows, rank].tolist()
        seconds[rank] = program_seconds(program, row, machine, times, float(share[rank]))
    return seconds, passes


def compute_lower_bound(graph: TaskGraph, plan: Plan, machine: Machine) -> float | None:
    """A bound below `plan`'s simulated step and its bulk-synchronous sum, whatever its
    parameters' homes: the busiest rank's compute (`cost.compute_per_rank`), which its core runs
    one task after another and which transfers only lengthen, without the zeroings (a first
    contribution may make one needless) and the updates (a gradient's kernel may take one in, and
    sharded homes shrink them). None where the machine times pieces (`Machine.pieces`): a
    rank's tasks may then run in modes timed below the rows priced here."""
    if machine.pieces:
        return None
    busy = np.zeros(plan.nranks)
    for task, seconds in zip(graph.tasks, compute_per_rank(graph, plan, machine)):
        if task.op not in ("set_zero", "update"):
            busy += seconds
    return float(busy.max(initial=0.0))


def simulate_compiled(
    programs: Mapping[int, RankProgram],
    compute: Mapping[int, Sequence[float]],
    machine: Machine,
    links: Links | None = None,
    passes: Mapping[int, TaskPasses] | None = None,
) -> SimulatedStep:
    """What `simulate_step` returns, float-equal, by the compiled loop (`runtime.step.loop`)
    over the programs flattened into instructions (`runtime.step.compiled`): a data-parallel
    resnet18 step on 64 ranks in about a second rather than a minute. Each rank's CPU work takes
    `cpu_slowdown` times as long as alone on its cores, and the network stack's CPU a byte of
    its transfers between hosts is the machine's."""
    # here, not at the top: a plan whose step is only summed (beyond the ranks simulated)
    # loads no Numba
    from runtime.step.compiled import flatten

    links = links or Links.of(machine, max(programs) + 1)
    prices = PassPrices.of(machine)
    passes = passes or passes_alone(programs, prices)
    slowdown = cpu_slowdown(machine, programs)
    return run_flat(flatten(programs, compute, links, passes, slowdown), machine, links, slowdown)


def run_flat(
    flat: FlatStep, machine: Machine, links: Links, slowdown: Mapping[int, float]
) -> SimulatedStep:
    """The step of the ranks whose instructions `flat` holds, run by the compiled loop."""
    from runtime.step.loop import run_step

    prices = PassPrices.of(machine)
    host = flat.host
    hosts = int(host.max()) + 1 if len(host) else 0
    ends = (flat.src >= 0) & (flat.dst >= 0)
    between = np.zeros(len(flat.src), bool)
    between[ends] = host[flat.src[ends]] != host[flat.dst[ends]]
    beta, stack_beta = links.rates(flat.nbytes, between)
    finish, waiting, computing, done = run_step(
        flat.ops, flat.op_ptr, flat.amounts, flat.keys, flat.src, flat.dst, flat.nbytes, host,
        hosts, flat.round_first, flat.round_count, flat.round_lo, flat.round_hi,
        flat.round_adds, flat.heap_room,
        np.asarray([slowdown[rank] for rank in flat.ranks], np.float64), beta, stack_beta,
        (links.alpha, links.beta, links.alpha_intra, prices.add, prices.per_message,
         float(links.burst), machine.network_cpu_seconds_per_byte, links.stack_beta,
         *map(float, links.held(True)), *map(float, links.held(False))),
    )  # fmt: skip
    stuck = sorted(rank for i, rank in enumerate(flat.ranks) if not done[i])
    if stuck:
        raise RuntimeError(f"step simulation: ranks {stuck} never finished (a deadlock)")
    ended = dict(zip(flat.ranks, finish.tolist()))
    return SimulatedStep(
        max(ended.values(), default=0.0),
        ended,
        dict(zip(flat.ranks, waiting.tolist())),
        compute=dict(zip(flat.ranks, computing.tolist())),
    )


def load_the_loop(machine: Machine) -> None:
    """Load the compiled loop (`loop.run_step`) from Numba's cache, as `run_flat` will call it
    (about 0.3 s), by running it over no ranks: a process that waits for others can load it
    meanwhile."""
    from runtime.step.flat_step import merged

    links = Links.of(machine, 1)
    run_flat(merged([], links), machine, links, {})


#: the most (rank, task) pairs whose programs a prediction builds, one per class of ranks alike,
#: to simulate a step (`rank_classes`): a data-parallel plan is simulated so on any number of
#: ranks, while a plan beyond this whose ranks all differ has every rank's program built in
#: shares (`SIMULATE_EVERY_RANK_MAX_WORK`)
SIMULATE_MAX_WORK = 50_000


#: the most work, in (rank, task) pairs, of a step whose ranks fall into more classes than
#: `SIMULATE_MAX_WORK` builds that a prediction builds one by one, every rank's own program, to
#: simulate it (`simulated_in_shares`, a share of the ranks per core); beyond this, the
#: bulk-synchronous sum. Messages count too (`MESSAGE_WORK`). Every built-in network's plans on
#: 1024 ranks are within it: on the 2-core VM vgg19's, 221,184 (rank, task) pairs each, simulate
#: in about 12 s with spatial splits (175,268 messages, 250,000 pairs of work), 14-15 s with
#: `auto`'s mixture (993,646) and 23-26 s with model parallelism (5.3 million messages, 1.1
#: million pairs of work, 2.4 GB), deep-mlp's model plan in 25-31 s (1.3 million)
SIMULATE_EVERY_RANK_MAX_WORK = 1_500_000
#: what a message costs to build, price and flatten at both ends, in (rank, task) pairs
MESSAGE_WORK = 1 / 6
#: what a task in which a rank has no part (`rank_parts`) costs to build, price and flatten
#: for it, in (rank, task) pairs: told at once (`Builder.idle`), it is still a task of the
#: rank's program, priced and flattened. Of vgg19's model plan on 8192 ranks, ranks 2048-2447
#: (a part in 13% of their tasks) built, priced and flattened at 105 µs a unit of work with
#: it at a half, as ranks 100-299 (a part in 74%) at 105 µs
IDLE_TASK_WORK = 1 / 2


def every_rank_work(graph: TaskGraph, plan: Plan) -> np.ndarray:
    """Per rank, the work of building, pricing and flattening its own program, in (rank, task)
    pairs: its tasks (`IDLE_TASK_WORK` each of those it has no part in), half a message's
    `MESSAGE_WORK` for each end of a message it is, and a message's for each round of each
    collective it joins (`collective_rounds`); none for a rank with a part in no task and no
    home (`rank_parts.idle_ranks`), whose step is nothing."""
    n = plan.nranks
    parts = has_part(plan).sum(axis=0)
    work = parts + IDLE_TASK_WORK * (len(plan.tasks) - parts)
    work[idle_ranks(plan)] = 0.0
    for task_plan in plan.tasks:
        for block in task_plan.transfer_set.blocks:
            ends = np.bincount(block.src, weights=block.fanout, minlength=n)
            ends += np.bincount(block.dsts, minlength=n)
            work += MESSAGE_WORK / 2 * ends
        for collective in task_plan.collectives:
            work[list(collective.participants)] += MESSAGE_WORK * collective_rounds(collective)
    return work


def message_work(plan: Plan) -> float:
    """The work of `plan`'s messages and collectives alone, in (rank, task) pairs
    (`MESSAGE_WORK` a message, both ends, and a participant's round of a collective): what
    telling its ranks apart (`rank_classes`) costs at least, since the step's events make every
    message of every rank, and what the compiled loop steps through at least (each
    participant's instance of a collective round by round, hops or none)."""
    messages = sum(len(block.dsts) for tp in plan.tasks for block in tp.transfer_set.blocks)
    rounds = sum(
        len(c.participants) * collective_rounds(c) for tp in plan.tasks for c in tp.collectives
    )
    return MESSAGE_WORK * (messages + rounds)


def collective_rounds(collective: Reduction) -> int:
    """⌈log2 p⌉ over its p participants: the fewest rounds its schedule takes
    (`partitioner.collectives`), which the budgets count whatever the machine's choice: the
    compiled loop steps each participant's instance round by round, hops or none. VGG19's
    model plan on 2048 ranks had 10.7 million participant-rounds by this count (1,048 reduces
    over 1,001 ranks into fc7's 2-column parts), where its schedules sent 1.24 million hops,
    and its step took 231 s to simulate on the 2-core VM; with those sums one reduce-scatter
    (`Reduction.contributors`) it has 0.23 million, as deep-mlp's has 0.43 million."""
    return max(1, math.ceil(math.log2(max(len(collective.participants), 2))))


def builds_on_budget(graph: TaskGraph, plan: Plan, most_built: int) -> bool:
    """Whether a prediction builds the programs of `plan` within `most_built` (rank, task)
    pairs (`programs.build_programs`): every rank's where they are within it, else one per
    class of ranks alike, told apart first, but not where its messages alone are past
    `SIMULATE_EVERY_RANK_MAX_WORK`: telling ranks apart makes every message of every rank,
    and such a step is summed at once. Deep-mlp's model plan on 2048 ranks made 29 million
    messages' ends over 17 s and 5.9 GB before its ranks were found to differ at its fifth
    task, and its step was summed."""
    within = plan.nranks * len(graph.tasks) <= most_built
    return within or message_work(plan) <= SIMULATE_EVERY_RANK_MAX_WORK


def simulates_every_rank(graph: TaskGraph, plan: Plan) -> bool:
    """Whether the step of `plan` is simulated however many classes its ranks fall into: its
    every rank's program built, within `SIMULATE_EVERY_RANK_MAX_WORK`."""
    return float(every_rank_work(graph, plan).sum()) <= SIMULATE_EVERY_RANK_MAX_WORK


def step_report(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    bulk_seconds: float,
    simulated_step: SimulatedStep | None,
) -> dict:
    """The step `partition` and `bench scaling` predict (`runtime.step.model.StepModel.
    step_prediction`): the simulated step (`simulated_step`, found by `simulate_compiled` where a
    plan's programs are within the work a prediction builds) where there is one, else the
    bulk-synchronous sum (`plan_cost`'s `bulk_seconds`), which is reported beside it in any
    case, each with the machine's time outside the tasks (`loop_us`). A simulated step also gets `compute_fraction`, the
    mean share of it a rank spends computing its tasks. A pipeline's also gets its bubble: the mean
    fraction of the simulated step its ranks wait, against (S − 1) / (M + S − 1), the bubble of
    S stages of equal work streaming M micro-batches with nothing else to wait for."""
    loop = machine.step_loop_seconds(plan.nranks)
    out = {"bulk_synchronous_seconds": bulk_seconds + loop}
    if simulated_step is None:
        summed = {"predicted_step_seconds": bulk_seconds + loop, "step_model": "bulk-synchronous"}
        return out | summed
    predicted = simulated_step.seconds + loop
    out |= {
        "predicted_step_seconds": predicted,
        "step_model": "simulated",
        "compute_fraction": simulated_step.compute_fraction(predicted),
    }
    stages = stages_of(graph)
    if stages > 1:
        micro_batches, _ = schedule_of(graph)
        out["bubble_fraction"] = simulated_step.waiting_fraction
        out["bubble_fraction_ideal"] = (stages - 1) / (micro_batches + stages - 1)
    return out


def objective_simulates(graph: TaskGraph, nranks: int) -> bool:
    """Whether `auto` compares plans of `graph` on `nranks` ranks by their simulated steps:
    wherever every candidate's programs are within `SIMULATE_MAX_WORK` however many classes its
    ranks fall into (`every_rank_within_budget`), so that every plan compared is simulated, or
    none (vgg19 up to 231 ranks, deep-mlp up to 649, seed-lcn up to 1,162); beyond, by their
    sums. The simulation a comparison needs is the one the command reports: vgg19's `auto` on
    224 ranks, 7.5 s with its candidates summed, took 7.9 s with them simulated, deep-mlp's on
    512 ranks 6.7 and 6.0 s, seed-lcn's on 1024 ranks 7.0 and 7.1 s."""
    return every_rank_within_budget(graph, nranks)


def every_rank_within_budget(graph: TaskGraph, nranks: int) -> bool:
    """Whether every rank's program of a step of `graph` on `nranks` ranks is within
    `SIMULATE_MAX_WORK` rank-task pairs, however its ranks fall into classes: what a simulation
    that walks every rank (`simulator.simulate_step`, which `render --timeline` draws) may take."""
    return nranks * len(graph.tasks) <= SIMULATE_MAX_WORK
