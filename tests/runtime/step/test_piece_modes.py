"""`runtime.step.piece_modes`: pieces timed as a step runs them (writing a gradient, or taking the
optimizer's step of an update fused into them), and the step priced from those times."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import cache_eviction, task_profile
from bench.machine import piece_rows
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.machine_file import machine_from_json
from partitioner.piece_times import piece_key
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.step.piece_modes import piece_mode
from runtime.step.prediction import predict_step
from runtime.step.programs import build_programs

BASE = {"rank_gflops": 10, "link_gbytes_per_s": 0.125, "latency_us": 30, "rank_memory_gib": 4}


@pytest.fixture(scope="module")
def one_rank():
    """seed-lcn-small's one-rank data plan under momentum, its program and a training sample:
    its filters' and classifier's gradients are written by their first contributions and their
    updates fused into them."""
    graph = load_network("seed-lcn-small").lower(batch=6, optimizer="momentum")
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    programs = build_programs(graph, plan, Machine(), [0])
    return graph, plan, programs, task_profile.sample_step(graph)


def _moded(programs) -> dict[str, str]:
    """Per task name, the mode its one piece runs in, where it runs one."""
    (program,) = programs.values()
    return {
        rt.task.name: mode
        for rt in program.tasks
        if rt.runs
        for piece in rt.pieces
        if (mode := piece_mode(program, rt, piece)) is not None
    }


def test_the_modes_name_what_is_written_and_what_is_stepped_by_which_optimizer(one_rank):
    _, _, programs, _ = one_rank
    moded = _moded(programs)
    (program,) = programs.values()
    stepping = {rt.task.name for rt in program.tasks if rt.steps}
    writing = {rt.task.name for rt in program.tasks if rt.fresh and rt.runs}
    assert stepping and set(moded) == writing | stepping
    for name in stepping:
        assert "steps" in moded[name] and "by momentum" in moded[name]
    assert any("writes" in mode for mode in moded.values())


def test_profiling_as_run_times_the_moded_pieces_and_counts_nothing_for_what_does_not_run(
    one_rank, monkeypatch
):
    graph, plan, programs, sample = one_rank
    (program,) = programs.values()
    calls = []

    def fake(graph, task, piece, executor, ctx, program=None, rt=None):
        calls.append((task.name, rt is not None))
        return 2.0 if rt is not None else 1.0

    monkeypatch.setattr(task_profile, "_time_piece", fake)
    cache: dict = {}
    seconds = task_profile.profile_plan(graph, plan, 1, sample, cache, programs)
    moded = _moded(programs)
    for rt in program.tasks:
        name = rt.task.name
        if not rt.runs:  # an elided zeroing, a fused update: nothing in the step
            assert seconds[name] == 0.0, name
        else:
            assert seconds[name] == (2.0 if name in moded else 1.0) * len(rt.pieces), name
    # every piece's plain time is there too (the bulk model and the search read those), and
    # each moded piece once more under its mode
    plain = {key for key in cache if len(json.loads(key[1])) == 5}
    assert plain == {(1, piece_key(t, p.rect.shape, p.requirements))
                     for t, tp in zip(graph.tasks, plan.tasks) for p in tp.pieces}  # fmt: skip
    as_run = {(1, piece_key(rt.task, p.rect.shape, p.requirements, moded[rt.task.name]))
              for rt in program.tasks if rt.task.name in moded for p in rt.pieces}  # fmt: skip
    assert set(cache) - plain == as_run
    assert sum(1 for _, timed_as_run in calls if timed_as_run) == len(as_run)


def test_timing_as_run_steps_copies_and_leaves_the_sample_as_it_was(one_rank):
    graph, plan, programs, (executor, ctx) = one_rank
    before = {name: array.copy() for name, array in executor.arrays.items()}
    cache: dict = {}
    with cache_eviction.evicting(cache_eviction.cheapest_cold()):  # what is timed is not checked
        seconds = task_profile.profile_plan(graph, plan, 1, (executor, ctx), cache, programs)
    for name, array in executor.arrays.items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)
    (program,) = programs.values()
    assert all(seconds[rt.task.name] > 0 for rt in program.tasks if rt.runs)


def test_a_step_is_priced_from_moded_rows_where_the_table_has_them(one_rank):
    """With plain rows alone, a fused update's time is added to the task it is fused into;
    with the moded rows too, that task takes its moded time (which holds the step), priced as
    any measured task (factor, overhead), and the update adds nothing."""
    graph, plan, programs, _ = one_rank
    (program,) = programs.values()
    cache: dict = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        for piece in task_plan.pieces:
            cache[(1, piece_key(task, piece.rect.shape, piece.requirements))] = 1e-3
    plain_rows = piece_rows(cache)
    moded = {}
    for rt in program.tasks:
        for piece in rt.pieces if rt.runs else []:
            mode = piece_mode(program, rt, piece)
            if mode is not None:
                key = (1, piece_key(rt.task, piece.rect.shape, piece.requirements, mode))
                moded[key] = cache[key] = 5e-3
                assert piece_rows({key: 5e-3})[0]["mode"] == mode
    assert moded
    factor, overhead = 1.5, 20e-6

    def machine(rows):
        return machine_from_json(
            {**BASE, "compute_factor": factor, "task_overhead_us": overhead * 1e6, "pieces": rows}
        )

    def task_seconds(machine):
        seen = {}

        def capture(programs, compute, machine, passes):
            seen.update(compute)

        predict_step(graph, plan, machine, programs=programs, simulate=capture)
        return seen[0]

    without = task_seconds(machine(plain_rows))
    with_moded = task_seconds(machine(piece_rows(cache)))
    for position, rt in enumerate(program.tasks):
        name = rt.task.name
        plain = 1e-3 * len(rt.pieces) * factor + overhead
        moded_time = 5e-3 * len(rt.pieces) * factor + overhead
        if not rt.runs:
            assert without[position] == with_moded[position] == 0.0, name
        elif rt.steps:
            updates = [program.tasks[p] for p in rt.steps.values()]
            added = sum(1e-3 * len(u.pieces) * factor for u in updates)
            assert without[position] == pytest.approx(plain + added), name
            assert with_moded[position] == pytest.approx(moded_time), name
        elif rt.fresh:
            assert without[position] == pytest.approx(plain), name
            assert with_moded[position] == pytest.approx(moded_time), name
        else:
            assert without[position] == with_moded[position] == pytest.approx(plain), name


def test_a_machine_file_mode_must_be_a_string():
    row = {"op": "linear", "phase": "forward", "attrs": {}, "shape": [1], "requirements": [],
           "seconds": 1.0, "mode": 3}  # fmt: skip
    with pytest.raises(LegionNNError, match=r"pieces\[0\]\.mode"):
        machine_from_json({**BASE, "pieces": [row]})
