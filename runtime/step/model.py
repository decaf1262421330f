"""A machine's predictions of plans, each plan's rank programs built once however often it is asked.

`auto` asks the same plans several things: the memory fit places each candidate's buffers
(`peak`), the comparison of candidates simulates the near ones' steps (`step`), and the command
then reports the plan it picked (`step_prediction`, `memory_prediction`). Every one of those
reads the plan's rank programs, the costliest thing to derive from a plan (a second and a half
for resnet18's 64 ranks), and the simulation. A `StepModel` keeps them per plan, found by what
makes the plan (its strategy's name and grids, its sharded homes, its ranks): the plan `auto`'s
fit built is the plan the command reports, and nothing about it is derived twice. The last
`KEPT_PROGRAMS` plans' programs are kept, so that a search over many plans holds a few, and the
last `KEPT_PLANS` plans it was asked about (where their programs are not built, on more ranks
than `step` simulates), so that the plan a command reports is not planned again either.

The functions a command hands `partitioner.resolve` (`peak`, `step`) are the model's methods; a
command makes one model per machine and asks it for the plan it reports (`plan`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

from legion_nn.cores import can_fork, spare_cores
from legion_nn.graph import TaskGraph
from partitioner import cost
from partitioner.machine import Machine
from partitioner.plan import Plan, build_plan
from partitioner.strategy import Strategy
from runtime.step.foresight import Foresight, shared_out
from runtime.step.prediction import (
    SIMULATE_MAX_WORK,
    builds_on_budget,
    compute_lower_bound,
    objective_simulates,
    predict_step,
    simulate_compiled,
    simulates_every_rank,
    step_report,
)
from runtime.step.programs import build_programs, ranks_all_differ
from runtime.step.rank_memory import (
    PLACED_MAX_RANKS,
    PlacedRanks,
    memory_prediction,
    placed_ranks,
    plan_peak,
)
from runtime.step.rank_program import RankProgram
from runtime.step.shared_programs import built
from runtime.step.simulated_in_shares import (
    simulate_in_shares,
    simulated_and_placed_in_shares,
)
from runtime.step.simulated_step import SimulatedStep

#: a job of `foresee`'s that places a plan's every rank is keyed (PLACED, the plan's key)
PLACED = "placed"
#: plans whose every rank's programs are kept (the candidates auto compares are fewer)
KEPT_PROGRAMS = 6
#: plans kept without their programs
KEPT_PLANS = 4
#: the fewest tasks of the programs built (one per class of ranks) whose memory `predictions`
#: places in a forked process: placing costs 65-105 µs a task on the 2-core VM (ResNet-18's data
#: plan on 64 ranks: 0.1 s), and the process some 0.35 s before it places (loading the compiled
#: placement, copying the pages it writes)
FORK_TO_PLACE = 5_000


def simulation_budget(nranks: int) -> int | None:
    """The most (rank, task) pairs whose programs `StepModel.simulated` builds to simulate a
    plan on `nranks` ranks: no limit up to `PLACED_MAX_RANKS` ranks, where the memory a command
    reports is placed from every rank's program anyway (so a simulated step costs only its
    simulation), else `SIMULATE_MAX_WORK`."""
    return None if nranks <= PLACED_MAX_RANKS else SIMULATE_MAX_WORK


class StepModel:
    """Predictions of plans on `machine`, kept per plan (see the module docstring)."""

    def __init__(self, machine: Machine, simulate_any_size: bool = False) -> None:
        self.machine = machine
        #: simulate every step asked about, past `prediction.SIMULATE_EVERY_RANK_MAX_WORK` too
        #: (`partition --simulate`: vgg19's model plan on 1024 ranks, 5.3 million messages,
        #: some 30 s and 2 GB on the 2-core VM), where a step is otherwise summed
        self.simulate_any_size = simulate_any_size
        #: the graphs planned, by id (held, so that an id names one graph while the model lives)
        self._graphs: dict[int, TaskGraph] = {}
        #: per plan (`_key`), the plan and every rank's program (None: beyond the work a
        #: simulation builds), the last `KEPT_PROGRAMS`
        self._programs: OrderedDict[tuple, tuple[Plan, Mapping[int, RankProgram] | None]] = (
            OrderedDict()
        )
        self._simulated: dict[tuple, SimulatedStep | None] = {}
        #: the last `KEPT_PLANS` plans asked about, by `_key`
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        #: processes the model may fork to work out plans it was told of (`looking_ahead`)
        self._workers = 0
        #: the processes at the jobs `foresee` gave, and the jobs still wanted, by key: a plan's
        #: `_key` for its (peak, step), `(PLACED, _key)` for its every rank placed
        self._foresights: list[Foresight] = []
        self._wanted: set[tuple] = set()
        #: per plan (`_key`) worked out ahead, its (peak, step)
        self._foreseen: dict[tuple, tuple[int, float]] = {}
        #: per plan (`_key`) whose every rank was placed ahead, what each share placed
        self._placed: dict[tuple, list[PlacedRanks]] = {}
        #: plans (`_key`) whose every rank is placed in shares when their peak is asked for
        self._place_in_shares: set[tuple] = set()

    def _key(self, graph: TaskGraph, name: str, unit_grids, sharded, nranks: int) -> tuple:
        self._graphs.setdefault(id(graph), graph)
        return id(graph), name, tuple(sorted(unit_grids.items())), frozenset(sharded), nranks

    def _plan_key(self, graph: TaskGraph, plan: Plan) -> tuple:
        return self._key(graph, plan.strategy, plan.unit_grids, plan.sharded, plan.nranks)

    def _strategy_key(self, graph: TaskGraph, strategy: Strategy, nranks: int) -> tuple:
        return self._key(graph, strategy.name, strategy.unit_grids, strategy.sharded, nranks)

    def plan(self, graph: TaskGraph, strategy: Strategy, nranks: int) -> Plan:
        """The plan of `strategy` on `nranks` ranks: the one whose programs were built, if
        they are kept."""
        key = self._strategy_key(graph, strategy, nranks)
        found = self._programs.get(key)
        if found is not None:
            return found[0]
        return self._plans.get(key) or build_plan(graph, strategy, nranks)

    def _keep(self, graph: TaskGraph, plan: Plan) -> None:
        key = self._plan_key(graph, plan)
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > KEPT_PLANS:
            self._plans.popitem(last=False)

    @contextmanager
    def looking_ahead(self, workers: int | None = None) -> Iterator[StepModel]:
        """Within the block, `foresee` works plans out in up to `workers` forked processes
        (default: one per core beyond this process's); their processes end with the block."""
        self._workers = spare_cores() if workers is None else workers
        try:
            yield self
        finally:
            self._workers = 0
            self._place_in_shares = set()
            self._stop_looking_ahead()

    def foresee(
        self,
        graph: TaskGraph,
        strategies: Sequence[Strategy],
        nranks: int,
        placing: Sequence[Strategy] = (),
    ) -> None:
        """Start working out `peak` and `step` of the plans of `strategies` on `nranks` ranks,
        which a search will ask for, in forked processes (`runtime.step.foresight`), where
        `looking_ahead` allows them and the plans' steps are simulated (a sum costs nothing
        to find) or their buffers placed (`peak`, up to `PLACED_MAX_RANKS` ranks): the values
        `peak` and `step` then give are the same, found meanwhile.

        Told again (auto once its search is done), the plans no longer among `strategies` are
        not begun, and each plan of `placing` (up to `PLACED_MAX_RANKS` ranks: one a command
        is likely to report) has its every rank placed (`rank_memory.placed_ranks`), which
        `peak` and `memory_prediction` then read: where its step is simulated and no process
        is at a job still wanted, by a process while this one simulates the step (resnet18's
        auto plan on 64 ranks: each some 3 s, its programs built in both), else when its peak
        is asked for, from the programs built here then: by a process while this one simulates
        the step (`_placed_while_simulating`), or in shares where the step was simulated
        already (ResNet-50's auto plan on 64 ranks: 2.2 s for the 5 ranks of
        `rank_memory.sampled_ranks` before, 4.8 s for all 64 in two shares)."""
        worth = objective_simulates(graph, nranks) or nranks <= PLACED_MAX_RANKS
        if not self._workers or not worth:
            return
        jobs: dict[tuple, Callable[[], object]] = {
            self._strategy_key(graph, s, nranks): partial(self._work_out, graph, s, nranks)
            for s in strategies
        }
        keyed = {self._strategy_key(graph, s, nranks): s for s in placing}
        to_place = {key: s for key, s in keyed.items() if key not in jobs}
        for foresight in self._foresights:  # a placement begun before stays wanted
            foresight.forgo(self._wanted - set(jobs) - {(PLACED, key) for key in to_place})
        if nranks <= PLACED_MAX_RANKS:
            for key, s in to_place.items():
                if objective_simulates(graph, nranks) and not self._busy():
                    jobs[(PLACED, key)] = partial(self._place_every_rank, graph, s, nranks)
                else:  # where no process may place it now: in shares once its peak is asked for
                    self._place_in_shares.add(key)
        new = {key: job for key, job in jobs.items() if key not in self._wanted}
        self._wanted = set(jobs)
        if new:
            self._foresights.append(Foresight(new, self._workers))

    def _look_ahead(self, jobs: Mapping[tuple, Callable[[], object]]) -> Foresight:
        """Processes for `jobs`, in place of those for the jobs given before (whose values
        are no longer wanted)."""
        self._stop_looking_ahead()
        self._foresights = [Foresight(jobs, self._workers)]
        self._wanted = set(jobs)
        return self._foresights[0]

    def _stop_looking_ahead(self) -> None:
        for foresight in self._foresights:
            foresight.close()
        self._foresights, self._wanted = [], set()

    def _busy(self) -> bool:
        """Whether a process works out a job still wanted (or one waits for it): a process
        forked meanwhile would take a core from it."""
        return any(foresight.busy() for foresight in self._foresights)

    def _take(self, key: tuple) -> tuple[bool, object]:
        """(True, the value of job `key`) where a process worked it out, else (False, None)."""
        for foresight in self._foresights:
            done, value = foresight.take(key)
            if done:
                return done, value
        return False, None

    @property
    def foreseen(self) -> list[str]:
        """The strategies (by name) of the plans whose values processes worked out and `peak`
        or `step` gave."""
        return [key[1] for key in self._foreseen]

    def _work_out(self, graph: TaskGraph, strategy: Strategy, nranks: int) -> tuple[int, float]:
        """(peak, step) of a plan, in a process `foresee` forked."""
        self._foresights = []  # this process's copy: it asks no one else
        plan = build_plan(graph, strategy, nranks)
        return self.peak(graph, plan), self.step(graph, plan)

    def _place_every_rank(self, graph: TaskGraph, strategy: Strategy, nranks: int) -> PlacedRanks:
        """Every rank of a plan placed, in a process `foresee` forked."""
        return placed_ranks(graph, build_plan(graph, strategy, nranks), self.machine)

    def _ahead(self, graph: TaskGraph, plan: Plan) -> tuple[int, float] | None:
        """(peak, step) of `plan` where a process `foresee` forked worked it out."""
        key = self._plan_key(graph, plan)
        found = self._foreseen.get(key)
        if found is None:
            done, value = self._take(key)
            if done:
                found = self._foreseen[key] = value
        return found

    def _placed_ahead(self, graph: TaskGraph, plan: Plan) -> list[PlacedRanks] | None:
        """Every rank of `plan` placed, where `foresee` was told to place them: by a process
        it forked, or in shares now."""
        key = self._plan_key(graph, plan)
        found = self._placed.get(key)
        if found is None:
            done, value = self._take((PLACED, key))
            if done:
                found = self._placed[key] = [value]
            elif key in self._place_in_shares and self._workers and can_fork() and not self._busy():
                # built here first: the report simulates the step from them, and every share
                # (or the process placing them all) reads them rather than building its own
                programs = self.programs(graph, plan, simulation_budget(plan.nranks))
                if programs is not None and key not in self._simulated:
                    found = self._placed[key] = [
                        self._placed_while_simulating(graph, plan, key, programs)
                    ]
                else:
                    found = self._placed[key] = self.placed_in_shares(graph, plan)
        return found

    def _placed_while_simulating(
        self, graph: TaskGraph, plan: Plan, key: tuple, programs: Mapping[int, RankProgram]
    ) -> PlacedRanks:
        """Every rank of `plan` (keyed `key`) placed from `programs` by a forked process while
        this one simulates the step (`_beside_simulation`): each process then loads Numba's
        compiled placement or loop once (about 0.6 s), where placing in shares had both load
        it for the placement, which then costs about what placing every rank does (a rank of
        each class in each share: ResNet-50's auto plan on 64 ranks, 17 classes, places all
        its ranks in 0.33 s and either half in 0.28 s), and simulated after."""
        job = partial(placed_ranks, graph, plan, self.machine, None, programs)
        apart = Foresight({key: job}, 1)
        try:
            return self._beside_simulation(graph, plan, apart, key, job)
        finally:
            apart.close()

    def _beside_simulation(
        self,
        graph: TaskGraph,
        plan: Plan,
        apart: Foresight | None,
        key: tuple,
        job: Callable[[], Any],
    ) -> Any:
        """`job`'s value, worked out by `apart`'s process (None: none) while this one simulates
        the step of `plan` that the command reports (`simulated`, kept), else here after it."""
        self.simulated(graph, plan)
        done, value = apart.take(key) if apart is not None else (False, None)
        return value if done else job()

    def _built(self, graph: TaskGraph, plan: Plan) -> Mapping[int, RankProgram] | None:
        """Every rank's program of `plan` where they were built here and kept, else None."""
        found = self._programs.get(self._plan_key(graph, plan))
        return found[1] if found is not None else None

    def programs(
        self, graph: TaskGraph, plan: Plan, most_built: int | None = None
    ) -> Mapping[int, RankProgram] | None:
        """Every rank's program of `plan`; None where `most_built` is given and building them
        would take more (rank, task) pairs (`programs.build_programs`), or telling its ranks
        apart more messages than a prediction makes (`prediction.builds_on_budget`: unless the
        model simulates any size of step)."""
        key = self._plan_key(graph, plan)
        found = self._programs.get(key)
        if found is None or (found[1] is None and most_built is None):
            if (
                most_built is None
                or self.simulate_any_size
                or builds_on_budget(graph, plan, most_built)
            ):
                built = build_programs(
                    graph, plan, self.machine, range(plan.nranks), most_built=most_built
                )
            else:
                built = None
            found = self._programs[key] = (plan, built)
            while len(self._programs) > KEPT_PROGRAMS:
                self._programs.popitem(last=False)
        self._programs.move_to_end(key)
        return found[1]

    def simulated(self, graph: TaskGraph, plan: Plan) -> SimulatedStep | None:
        """The simulated step of `plan`, without the machine's time outside the tasks: from
        its programs where they are within `simulation_budget`, else from every rank's own
        built in shares (`simulated_in_shares`, on the cores `looking_ahead` allows) where
        they are within `prediction.SIMULATE_EVERY_RANK_MAX_WORK` or the model simulates any
        size of step (`simulate_any_size`); else None."""
        key = self._plan_key(graph, plan)
        if key not in self._simulated:
            programs = self.programs(graph, plan, simulation_budget(plan.nranks))
            if programs is not None:
                self._simulated[key] = predict_step(
                    graph, plan, self.machine, programs=programs, simulate=simulate_compiled
                )
            elif self.simulate_any_size or simulates_every_rank(graph, plan):
                workers = 0 if self._busy() else self._workers
                self._simulated[key] = simulate_in_shares(graph, plan, self.machine, workers)
            else:
                self._simulated[key] = None
        return self._simulated[key]

    def step(self, graph: TaskGraph, plan: Plan, bulk_seconds: float | None = None) -> float:
        """A plan's predicted step as `auto` compares it (`partitioner.resolve`): the simulated
        step with the machine's time outside the tasks where every plan of its graph and ranks
        would be (`prediction.objective_simulates`), else the bulk-synchronous sum
        (`bulk_seconds`, where the caller has found it already)."""
        ahead = self._ahead(graph, plan)
        if ahead is not None:
            return ahead[1]
        loop = self.machine.step_loop_seconds(plan.nranks)
        if objective_simulates(graph, plan.nranks):
            found = self.simulated(graph, plan)
            if found is not None:
                return found.seconds + loop
        self._keep(graph, plan)
        if bulk_seconds is None:
            bulk_seconds = cost.bulk_seconds(graph, plan, self.machine)
        return bulk_seconds + loop

    def compared_steps(self, graph: TaskGraph, plan: Plan) -> tuple[float, float | None]:
        """A plan's bulk-synchronous sum and its simulated step, each with the machine's time
        outside the tasks, as `--stages auto` compares its candidates
        (`partitioner.resolve.resolve_stages`): simulated where `step` simulates it, or on more
        ranks where its programs, one per class of ranks alike, are within `SIMULATE_MAX_WORK`
        (a data-parallel step on any number of ranks: vgg19's 4 stages of it on 1024 ranks
        in 3.5 s); else None (a plan whose ranks all differ, simulated in shares only for the
        plan a command reports)."""
        loop = self.machine.step_loop_seconds(plan.nranks)
        summed = cost.bulk_seconds(graph, plan, self.machine)
        if objective_simulates(graph, plan.nranks):  # `step`'s, found ahead where it was
            return summed + loop, self.step(graph, plan, summed)
        if self.programs(graph, plan, SIMULATE_MAX_WORK) is not None:
            found = self.simulated(graph, plan)
            if found is not None:
                return summed + loop, found.seconds + loop
        self._keep(graph, plan)
        return summed + loop, None

    def step_is_sum(self, graph: TaskGraph, nranks: int) -> bool:
        """Whether `step` gives plans of `graph` on `nranks` ranks their bulk-synchronous sums
        (with the machine's time outside the tasks), which `auto`'s DP adds up exactly."""
        return not objective_simulates(graph, nranks)

    def step_lower_bound(self, graph: TaskGraph, plan: Plan) -> float | None:
        """A bound below `step` for `plan` with any parameters' homes, cheap beside it (no
        rank's program is built): `prediction.compute_lower_bound` with the machine's time
        outside the tasks; None where there is none."""
        bound = compute_lower_bound(graph, plan, self.machine)
        return None if bound is None else bound + self.machine.step_loop_seconds(plan.nranks)

    def peak(self, graph: TaskGraph, plan: Plan) -> int:
        """The most bytes a rank of `plan` holds with its baseline (`memory.plan_peak`):
        what `auto` fits in memory. Where `step` simulates the plan, from every rank's programs,
        built here once for both (placing a few ranks' buffers alone costs most of what
        building them all does, since a plan's messages are found for every rank at once)."""
        ahead = self._ahead(graph, plan)
        if ahead is not None:
            return ahead[0]
        placed = self._placed_ahead(graph, plan)
        if placed is not None:
            self._keep(graph, plan)  # the plan a command likely reports: not planned again
            return plan_peak(graph, plan, self.machine, placed=placed)
        programs = self._built(graph, plan)
        if programs is None and objective_simulates(graph, plan.nranks):
            programs = self.programs(graph, plan, SIMULATE_MAX_WORK)
        if programs is not None:
            return plan_peak(graph, plan, self.machine, programs)
        self._keep(graph, plan)
        return plan_peak(graph, plan, self.machine)

    def step_prediction(self, graph: TaskGraph, plan: Plan, bulk_seconds: float) -> dict:
        """`prediction.step_report` of `plan`, its simulation made once: simulated wherever
        `simulated` simulates it, whatever `step` compares."""
        return step_report(graph, plan, self.machine, bulk_seconds, self.simulated(graph, plan))

    def memory_prediction(self, graph: TaskGraph, plan: Plan) -> dict:
        """`memory.memory_prediction` of `plan`, from the programs built already; where they
        are not (beyond the work a simulation builds) and `looking_ahead` allows processes, the
        ranks are built and placed in contiguous shares, one in this process and one in each
        forked process (`placed_in_shares`)."""
        if plan.nranks > PLACED_MAX_RANKS:
            return memory_prediction(graph, plan, self.machine)
        placed = self._placed_ahead(graph, plan)
        if placed is not None:
            return memory_prediction(graph, plan, self.machine, placed=placed)
        if self._built(graph, plan) is None and self._workers and can_fork():
            placed = self.placed_in_shares(graph, plan)
            return memory_prediction(graph, plan, self.machine, placed=placed)
        return memory_prediction(graph, plan, self.machine, self.programs(graph, plan))

    def placed_in_shares(self, graph: TaskGraph, plan: Plan) -> list[PlacedRanks]:
        """Every rank of `plan` built (unless built here already) and placed
        (`rank_memory.placed_ranks`) in `_workers` + 1 contiguous shares (fewer where there are
        fewer ranks), the last in this process while forked processes take the others:
        building a rank's program for Inception v2's auto plan on 64 ranks costs some 0.17 s,
        and the messages every share finds first some 2 s more."""
        programs = self._built(graph, plan)  # where built here, each share reads them
        shares = np.array_split(np.arange(plan.nranks), min(self._workers + 1, plan.nranks))
        jobs = {
            k: partial(placed_ranks, graph, plan, self.machine, share.tolist(), programs)
            for k, share in enumerate(shares)
        }
        return list(self.share_out(jobs).values())

    def share_out(self, jobs: Mapping[Hashable, Callable[[], Any]]) -> dict[Hashable, Any]:
        """Every job's value, worked out here and, where `looking_ahead` allows, in forked
        processes at once (`foresight.shared_out`)."""
        return shared_out(jobs, self._workers)

    def predictions(self, graph: TaskGraph, plan: Plan) -> tuple[cost.PlanCost, dict, dict]:
        """`cost.plan_cost`, `step_prediction` and `memory_prediction` of `plan`, as a command
        reports it. The cost and the memory are found in a forked process while this one
        simulates the step (each reads the same programs, built before the fork; DenseNet-121's
        data plan on 64 ranks simulates in 1.5 s, and costs and places in 1.3 s) where
        `looking_ahead` allows a process, neither is found yet, and the programs to place are
        worth a process (`FORK_TO_PLACE`)."""
        key = self._plan_key(graph, plan)
        job = partial(self._cost_and_memory, graph, plan)
        apart = None
        if self._workers and key not in self._simulated and plan.nranks <= PLACED_MAX_RANKS:
            if self._in_shares(graph, plan, key):
                self._simulated[key], self._placed[key] = simulated_and_placed_in_shares(
                    graph, plan, self.machine, self._workers
                )
            else:
                programs = self.programs(graph, plan, simulation_budget(plan.nranks))
                tasks = 0 if programs is None else sum(len(p.tasks) for p in built(programs))
                if tasks >= FORK_TO_PLACE:
                    apart = self._look_ahead({key: job})
        summed, memory = self._beside_simulation(graph, plan, apart, key, job)
        return summed, self.step_prediction(graph, plan, summed.step_seconds), memory

    def _in_shares(self, graph: TaskGraph, plan: Plan, key: tuple) -> bool:
        """Whether `predictions` builds every rank's own program of `plan` (keyed `key`) in
        shares, each share simulated and placed by a process of its own
        (`simulated_and_placed_in_shares`): its ranks all differ (`programs.ranks_all_differ`:
        DenseNet-121's spatial plan on 64 ranks builds for 10 s on one core), neither its
        programs nor its placement are found yet, and no process is at a job still wanted."""
        return (
            self._built(graph, plan) is None
            and key not in self._placed
            and can_fork()
            and not self._busy()
            and ranks_all_differ(plan, range(plan.nranks))
        )

    def _cost_and_memory(self, graph: TaskGraph, plan: Plan) -> tuple[cost.PlanCost, dict]:
        return cost.plan_cost(graph, plan, self.machine), self.memory_prediction(graph, plan)
