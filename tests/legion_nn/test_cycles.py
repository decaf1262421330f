"""The cycle collector kept off planning's heaps: paused inside the work, what the work leaves
alive aged into the oldest generation after it, and a command's objects left to its exit."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest

import cli.main
from legion_nn.cycles import collecting_past_setup, no_cycle_collection
from runtime.rank_executor import RankExecutor
from runtime.training import Trainer


class Node:
    def __init__(self) -> None:
        self.other = self


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    if not was:
        gc.disable()


def _in_generation(obj, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_paused_inside_and_resumed_after(collector_on):
    with no_cycle_collection():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_inside_a_pause_leaves_the_collector_paused(collector_on):
    with no_cycle_collection():
        with no_cycle_collection():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_what_the_work_keeps_is_aged_not_walked_as_it_resumes(collector_on):
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    with no_cycle_collection():
        kept = [[i] for i in range(20000)]
        assert gc.get_count()[0] >= 20000  # the youngest generation holds them all
        gc.callbacks.append(record)
    gc.callbacks.remove(record)
    assert started == []  # resuming would otherwise walk the 20,000 at the next allocation
    assert gc.get_count()[0] < 1000
    assert _in_generation(kept[0], 2)
    assert gc.get_freeze_count() == 0  # aged, not exempt


def test_a_cycle_made_inside_is_still_collected(collector_on):
    with no_cycle_collection():
        node = Node()
        alive = weakref.ref(node)
        del node
        gc.collect()  # an explicit collection still runs while paused
        assert alive() is None
        node = Node()
        alive = weakref.ref(node)
        del node
    assert alive() is not None
    gc.collect()
    assert alive() is None


def test_the_command_exits_with_its_code_and_leaves_its_objects_to_the_exit(
    collector_on, monkeypatch
):
    monkeypatch.setattr(cli.main, "main", lambda: 3)
    gc.unfreeze()
    with pytest.raises(SystemExit) as exited:
        cli.main.entry()
    assert exited.value.code == 3
    assert gc.get_freeze_count() > 0


def test_inside_the_steps_collection_is_on_and_what_was_alive_is_exempt(collector_on):
    gc.disable()
    before = [[i] for i in range(1000)]
    with collecting_past_setup():
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(before)
        node = Node()
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None  # what the steps make is collected
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_a_training_job_collects_only_during_its_steps(collector_on, monkeypatch):
    """`train`: no collection while it starts (imports, kernels, plan, program), collection on
    with the start-up's objects frozen while it steps, and all as it was after."""
    seen = {}
    prepare, step = RankExecutor.prepare, Trainer.step

    def preparing(self, graph, *initial):
        seen.setdefault("setup", gc.isenabled())
        return prepare(self, graph, *initial)

    def stepping(self, i):
        seen.setdefault("step", (gc.isenabled(), gc.get_freeze_count() > 0))
        return step(self, i)

    monkeypatch.setattr(RankExecutor, "prepare", preparing)
    monkeypatch.setattr(Trainer, "step", stepping)
    assert cli.main.main(["train", "--steps", "2", "--no-progress"]) == 0
    assert seen == {"setup": False, "step": (True, True)}
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    "command, paused",
    [("partition", True), ("render", True), ("memory", True), ("bench", False), ("launch", False)],
)
def test_planning_commands_run_with_the_collector_paused(
    collector_on, monkeypatch, command, paused
):
    """What a planning command allocates it keeps to its end; the commands that loop over jobs
    (`bench`, `launch`) collect as usual."""
    module = importlib.import_module(f"cli.commands.{command}")
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(gc.isenabled()) or 0)
    argv = {"partition": ["seed-lcn-small", "--ranks", "2"], "render": ["seed-lcn-small", "-o", "x.svg"],
            "memory": ["seed-lcn-small"], "bench": ["kernels"],
            "launch": ["-n", "1", "--", "true"]}[command]  # fmt: skip
    assert cli.main.main([command, *argv]) == 0
    assert seen == [not paused]
    assert gc.isenabled()
