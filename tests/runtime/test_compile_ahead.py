"""Compiling a run's kernels ahead: how its units are shared among processes, the helpers that
compile beside a run, and that a run after them compiles nothing (on an empty Numba cache)."""

import os
import subprocess
import sys
import textwrap

import pytest

from legion_nn.networks import load_network
from runtime.compile_ahead import GEMM_GROUPS, GEMM_SECONDS, STEP_GROUPS, assign
from runtime.compile_helpers import WAIT, Helpers
from runtime.compile_units import UNITS
from tests.paths import ROOT


def graph_of(name: str, optimizer: str = "adam"):
    return load_network(name).lower(batch=4, dtype="float32", optimizer=optimizer)


@pytest.mark.parametrize("processes", [1, 2, 3, 5])
def test_every_unit_goes_to_one_process_and_a_group_stays_together(processes):
    units = list(UNITS)
    shares = assign(units, processes)
    assert len(shares) == processes
    assert sorted(u for share in shares for u in share) == sorted(units)
    owner = {u: i for i, share in enumerate(shares) for u in share}
    groups = {UNITS[u].group for u in units}
    weight = {g: sum(UNITS[u].weight() for u in units if UNITS[u].group == g) for g in groups}
    for group in groups:  # together
        assert len({owner[u] for u in units if UNITS[u].group == group}) == 1, group
    first = max(groups, key=weight.__getitem__)
    assert {owner[u] for u in units if UNITS[u].group == first} == {0}  # the heaviest, first
    loads = [sum(UNITS[u].weight() for u in share) for share in shares]
    # longest-first greedy: no process is more than its heaviest unit above the lightest
    heaviest = max(weight.values())
    assert max(loads) - min(loads) <= heaviest + GEMM_SECONDS


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
    gemm = [u for u in units if UNITS[u].group in GEMM_GROUPS]
    heaviest = max(gemm, key=lambda u: sum(
        UNITS[v].weight() for v in gemm if UNITS[v].group == UNITS[u].group))  # fmt: skip
    assert heaviest in shares[first[0]]  # the group that took the GEMM's compile with it


@pytest.mark.parametrize(("before", "begun"), [([], True), (["filter.untied"], False)])
def test_a_run_after_compiling_ahead_with_a_helper_compiles_nothing(tmp_path, before, begun):
    """On an empty cache, with a helper begun before the units are known (`Helpers`), or on one
    holding the main process's share (`before`), with a helper started for the rest: the main
    process and the helper compile the default network's units between them; training then
    compiles no kernel, and no helper is left running."""
    script = textwrap.dedent(
        f"""
        import os
        import numba
        from numba.core import event
        from cli.main import main
        from legion_nn.networks import load_network
        from runtime.compile_ahead import cache_is_cold, compile_ahead
        from runtime.compile_helpers import Helpers
        from runtime.compile_units import cached, units_of, warm

        graph = load_network("seed-lcn-small").lower(batch=8, dtype="float32", optimizer="adam")
        units = units_of(graph)
        numba.set_num_threads(1)  # the plain loops, which a run of two steps chooses
        warm({before!r}, "float32")
        assert not cached(units, "float32")
        if {begun!r}:
            assert cache_is_cold("float32")
            with Helpers(1) as helpers:
                compile_ahead(units, "float32", helpers=helpers)
        else:
            compile_ahead(units, "float32", helpers=1)
        assert cached(units, "float32")
        assert not cache_is_cold("float32")
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


def test_helpers_given_nothing_exit_and_helpers_never_given_a_share_are_ended():
    with Helpers(2) as helpers:
        assert len(helpers) == 2
        assert helpers.give(["", ""]) == []
        for process in helpers.processes:
            assert process.wait(timeout=120) == 0  # an empty line: nothing to compile
    unused = Helpers(1)
    (process,) = unused.processes
    unused.close()  # as a run that fails before it compiles, or finds the cache warm
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


def test_helpers_are_begun_without_importing_numba():
    """A one-process run starts its helpers before it imports the kernels (0.3 s of its cold
    start), so their module must not import them itself."""
    script = (
        "import sys, runtime.compile_helpers; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('numba', 'numpy', 'llvmlite')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_each_helper_is_told_its_share_unless_it_is_empty_or_cached(monkeypatch):
    import numba

    from runtime import compile_ahead

    monkeypatch.setattr(compile_ahead, "cached", lambda share, dtype: share == ["filterA"])
    told = compile_ahead.orders([["softmax", "filterNL"], [], ["filterA"]], "float64")
    assert told == [f"float64 {numba.get_num_threads()} softmax filterNL", "", ""]


@pytest.mark.parametrize("given", [True, False])
def test_the_probes_cache_index_is_where_numba_keeps_it_and_tells_a_warm_cache(tmp_path, given):
    """`cache_may_be_warm` finds Numba's index of the probe by its file name, without Numba:
    the folder and name are the ones Numba's own cache uses (with `NUMBA_CACHE_DIR` or in the
    source tree), and on an empty cache it says cold until the probe's unit is compiled."""
    script = textwrap.dedent(
        """
        import os
        from runtime.compile_helpers import cache_may_be_warm, probe_cache_folders
        from runtime.compile_ahead import cache_is_cold
        from runtime.compile_units import UNITS, warm

        probe = UNITS["linear"].probe
        for twin in (probe.serial, probe.parallel):
            index = twin._cache._cache_file._index_path
            assert os.path.dirname(index) in map(str, probe_cache_folders()), index
            assert os.path.basename(index).startswith(("linear._tiled_product",)), index
        if os.environ.get("NUMBA_CACHE_DIR"):
            assert not cache_may_be_warm() and cache_is_cold("float32")
            warm(["linear"], "float32")
            assert cache_may_be_warm() and not cache_is_cold("float32")
        print("agreed")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    if given:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    assert "agreed" in _python(script, env)


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
