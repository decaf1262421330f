"""Compiling a run's kernels ahead: how its units are shared among processes, the helpers that
compile beside a run, and that a run after them compiles nothing (on an empty Numba cache)."""

import itertools
import os
import subprocess
import sys
import textwrap
import time

import pytest

from legion_nn.networks import load_network
from runtime import compile_ahead
from runtime.compile_ahead import GEMM_GROUPS, GEMM_SECONDS, STEP_GROUPS, WAIT, Helpers, assign
from runtime.compile_units import UNITS
from tests.paths import ROOT


def graph_of(name: str, optimizer: str = "adam"):
    return load_network(name).lower(batch=4, dtype="float32", optimizer=optimizer)


#: the default job's units, and a GPT's
JOBS = {
    "seed-lcn-small": ["filter.untied", "filter.step", "filterA", "filterNL", "linear",
                       "linear.step", "softmax", "update"],
    "gpt": ["linear", "linear.step", "softmax", "embedding", "layernorm", "matmul",
            "row_softmax", "gelu", "update", "update.parallel"],
}  # fmt: skip


@pytest.mark.parametrize("processes", [1, 2, 3, 5])
def test_every_unit_goes_to_one_process_and_a_group_stays_together(processes):
    units = list(UNITS)
    shares = assign(units, processes)
    assert len(shares) == processes
    assert sorted(u for share in shares for u in share) == sorted(units)
    owner = {u: i for i, share in enumerate(shares) for u in share}
    for group in {UNITS[u].group for u in units}:
        assert len({owner[u] for u in units if UNITS[u].group == group}) == 1, group


def _groups(shares: list[list[str]]) -> list[list[str]]:
    return [sorted({UNITS[u].group for u in share}) for share in shares]


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize(("processes", "late"), [(2, 0.0), (2, 0.5), (3, 0.0)])
@pytest.mark.parametrize("tries_every", [True, False])
def test_the_compiling_ends_as_soon_as_under_the_best_placement_of_the_groups(
    job, processes, late, tries_every, monkeypatch
):
    """Against every placement of the job's groups on the processes, timed by the same
    schedule (the GEMM compiled once, its callers elsewhere waiting for it): the best where
    `assign` tries every placement, within a tenth of it where it places the groups longest
    first and improves on that."""
    monkeypatch.setattr(compile_ahead, "EVERY_PLACEMENT_UP_TO", 10**6 if tries_every else 0)
    units = JOBS[job]
    weight = {}
    for u in units:
        weight[UNITS[u].group] = weight.get(UNITS[u].group, 0.0) + UNITS[u].weight()
    keys = sorted(weight)
    best = min(
        compile_ahead._ends(
            [[k for k, p in zip(keys, places) if p == i] for i in range(processes)], weight, late
        )[0]
        for places in itertools.product(range(processes), repeat=len(keys))
    )
    chosen = compile_ahead._ends(_groups(assign(units, processes, late)), weight, late)[0]
    assert chosen <= (best if tries_every else 1.1 * best) + 1e-9, (chosen, best)


def test_a_process_calling_the_gemm_waits_for_the_one_compiling_it():
    """The schedule `assign` minimises: the process compiling the GEMM ends after it and its
    share; another reaches its GEMM callers once its other units are compiled and the GEMM is,
    and a process with no callers never waits."""
    weight = {"step": 1.0, "gemm": 0.5, "update": 0.25, "softmax": 3.0}
    placed = [["step"], ["update", "gemm"], ["softmax"]]
    ends = compile_ahead._ends_with_gemm_at(placed, weight, 0.5, 0)
    waited = max(0.5 + 0.25, GEMM_SECONDS) + 0.5
    assert list(ends) == sorted([GEMM_SECONDS + 1.0, waited, 0.5 + 3.0], reverse=True)
    ends = compile_ahead._ends_with_gemm_at(placed, weight, 0.5, 1)  # starting half a second on
    waited = 0.5 + GEMM_SECONDS + 1.0
    assert list(ends) == sorted([waited, 0.5 + GEMM_SECONDS + 0.75, 0.5 + 3.0], reverse=True)


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize("late", [0.0, 1.0])
def test_one_process_compiles_the_gemm_first_and_the_others_reach_it_last(processes, late):
    """The default job's units on its two ranks (and with a helper): the process holding the
    first GEMM callers starts with them; every other process's callers come after the rest of
    its share, so the GEMM is in the cache when it gets there."""
    units = ["filter.untied", "filter.untied.gradient", "filterA", "filterNL", "linear",
             "softmax", "update", "update.parallel"]  # fmt: skip
    shares = assign(units, processes, late)
    calls = [[UNITS[u].group in GEMM_GROUPS for u in share] for share in shares]
    first = [i for i, share in enumerate(calls) if share and share[0]]
    assert len(first) == 1
    for i, share in enumerate(calls):
        if i != first[0] and any(share):
            assert share == sorted(share), shares  # the rest, then the GEMM's callers
        steps = [UNITS[u].group in STEP_GROUPS for u in shares[i]]
        if i != first[0] and any(steps):  # the optimizer's step first, which the callers call
            assert steps == sorted(steps, reverse=True), shares


@pytest.mark.parametrize(("before", "forks"), [([], True), ([], False), (["filter.untied"], True)])
def test_a_run_after_compiling_ahead_with_a_helper_compiles_nothing(tmp_path, before, forks):
    """On an empty cache, or on one holding some of the units (`before`), with a helper
    forked from the process or, where it may not fork, a new interpreter: the main process and
    the helper compile the default network's units between them; training then compiles no
    kernel, and no helper is left running."""
    script = textwrap.dedent(
        f"""
        import os
        import numba
        from numba.core import event
        from cli.main import main
        from legion_nn.networks import load_network
        from runtime import compile_ahead as ahead
        from runtime.compile_units import cached, units_of, warm

        graph = load_network("seed-lcn-small").lower(batch=8, dtype="float32", optimizer="adam")
        units = units_of(graph)
        numba.set_num_threads(1)  # the plain loops, which a run of two steps chooses
        warm({before!r}, "float32")
        assert not cached(units, "float32")
        forked = []
        fork = ahead._forked
        ahead._forked = lambda share, dtype: forked.append(share) or fork(share, dtype)
        if not {forks!r}:
            ahead.can_fork = lambda: False
        ahead.compile_ahead(units, "float32", helpers=1)
        assert cached(units, "float32")
        assert len(forked) == (1 if {forks!r} else 0), forked  # the other share
        children = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
        assert not children, children
        with event.install_recorder("numba:compile") as compiled:
            main(["train", "--steps", "2", "--batch", "8", "--no-progress"])
        names = [e.data["dispatcher"].py_func.__qualname__ for _, e in compiled.buffer if e.is_start]
        assert not names, names
        print("compiled nothing")
        """
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    assert "compiled nothing" in _python(script, env)


def test_a_forked_helper_that_fails_or_hangs_is_reaped_and_the_run_goes_on():
    """A copy that raises exits without running the run's exit handlers, reaped; one that outlives
    `HELPER_TIMEOUT_S` is killed; neither is left behind (in a child Python: pytest's workers
    run threads, which a fork must not copy)."""
    script = textwrap.dedent(
        """
        import atexit, os, time
        from runtime import compile_ahead as ahead

        atexit.register(lambda: print("exit handler ran in", os.getpid()))
        def warm(share, dtype):
            if share == ["hang"]:
                time.sleep(60)
            raise RuntimeError("no such unit")
        ahead.warm = warm
        ahead.HELPER_TIMEOUT_S = 0.5
        failing, hanging = ahead._forked(["fail"], "float32"), ahead._forked(["hang"], "float32")
        running = {failing, hanging}
        started = time.monotonic()
        ahead._wait_for(running)
        waited = time.monotonic() - started
        assert 0.5 <= waited < 5, waited
        assert running == {hanging}, running  # the failing one reaped
        try:
            os.waitpid(failing, os.WNOHANG)
            raise AssertionError("the failing copy was not reaped")
        except ChildProcessError:
            pass
        ahead._end(running)
        assert not running
        children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
        assert not children, children
        print("reaped", os.getpid())
        """
    )
    out = _python(script, dict(os.environ))
    assert out.count("exit handler ran in") == 1 and "reaped" in out  # the parent's, once


def test_a_run_on_more_threads_starts_new_interpreters_rather_than_forking(tmp_path):
    """GNU OpenMP ends a forked copy of a process that has started its threads once the copy
    runs a parallel loop (and asking Numba's thread count starts them): a run on two threads
    compiles beside a new interpreter; the copy it would have forked dies as said."""
    script = textwrap.dedent(
        """
        import os
        import numba, numpy as np
        from runtime import compile_ahead as ahead
        from runtime.compile_units import cached, warm

        forked = []
        fork = ahead._forked
        ahead._forked = lambda share, dtype: forked.append(share) or fork(share, dtype)
        numba.set_num_threads(2)
        units = ["filterA", "softmax", "maxpool", "avgpool"]
        ahead.compile_ahead(units, "float32", helpers=1)
        assert not forked and cached(units, "float32")
        if numba.threading_layer() == "omp":  # what a copy on two threads would meet
            copy = os.fork()
            if copy == 0:
                warm(["dropout"], "float32")
                os._exit(0)
            assert os.waitpid(copy, 0)[1] != 0
        print("new interpreters")
        """
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), NUMBA_NUM_THREADS="2")
    assert "new interpreters" in _python(script, env)


def test_units_without_plain_loops_are_not_given_to_a_copy(tmp_path):
    """GELU's kernels run parallel loops on one thread too, which a copy of a process that has
    started its threads may not: a run whose helper's share holds them starts a new
    interpreter, and one whose shares do not still forks."""
    script = textwrap.dedent(
        """
        import numba
        from runtime import compile_ahead as ahead
        from runtime.compile_units import cached, parallel_only

        assert parallel_only(["gelu"]) and not parallel_only(["filterA", "softmax", "embedding"])
        forked = []
        fork = ahead._forked
        ahead._forked = lambda share, dtype: forked.append(share) or fork(share, dtype)
        numba.set_num_threads(1)
        ahead.assign = lambda units, processes, late=0.0: [units[1:], units[:1]]  # the first
        ahead.compile_ahead(["gelu", "filterA"], "float32", helpers=1)  # to the helper
        assert not forked and cached(["gelu", "filterA"], "float32"), forked
        ahead.compile_ahead(["softmax", "maxpool"], "float32", helpers=1)
        assert forked == [["softmax"]] and cached(["softmax", "maxpool"], "float32"), forked
        print("forked without gelu")
        """
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    assert "forked without gelu" in _python(script, env)


def test_helpers_given_nothing_exit_and_helpers_never_given_a_share_are_ended():
    with Helpers(2) as helpers:
        assert len(helpers) == 2
        assert helpers.give(["", ""]) == []
        for process in helpers.processes:
            assert process.wait(timeout=120) == 0  # an empty line: nothing to compile
    unused = Helpers(1)
    (process,) = unused.processes
    unused.close()  # as a run that fails before it gives them their shares
    assert process.poll() is not None
    assert not unused  # none left to give work to
    assert not Helpers(0)


@pytest.mark.parametrize(
    "told", ["float32 x filterA", "float32 0 filterA", "int8 1", "float32 1 conv9"]
)
def test_a_waiting_helper_told_nonsense_exits_2_naming_its_usage(told):
    done = subprocess.run(
        [sys.executable, "-m", "runtime.compile_ahead", WAIT],
        input=told + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m runtime.compile_ahead")


def test_each_helper_is_told_its_share_unless_it_is_empty_or_cached(monkeypatch):
    import numba

    from runtime import compile_ahead

    monkeypatch.setattr(compile_ahead, "cached", lambda share, dtype: share == ["filterA"])
    told = compile_ahead.orders([["softmax", "filterNL"], [], ["filterA"]], "float64")
    assert told == [f"float64 {numba.get_num_threads()} softmax filterNL", "", ""]


def _python(script: str, env: dict[str, str]) -> str:
    """The stdout of `script` run by a child Python that imports this checkout, which must
    succeed."""
    env = dict(env, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_processes_of_a_host_compile_the_gemm_once(tmp_path):
    """Two processes asking for the GEMM at once on an empty cache: one compiles it and the
    other waits for it and loads what the first wrote (`microkernel._compiled_once`), where
    each had compiled it when one reached it before the other had written it."""
    script = textwrap.dedent(
        """
        import sys, time
        import numpy as np
        from runtime.kernels import microkernel

        start = float(sys.argv[1])
        time.sleep(max(start - time.time(), 0.0))  # both ask at once
        microkernel.kernels(np.float32)
        print("hits", microkernel._COMPILED[0].cache_hits)
        """
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    start = f"{time.time() + 3.0:.3f}"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, start],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    hits = sorted(child.communicate(timeout=300)[0].split()[-1] for child in children)
    assert [child.returncode for child in children] == [0, 0]
    assert hits == ["0", "1"]  # one compiled, the other loaded
