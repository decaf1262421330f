"""`bench/unit_compile_seconds.py` times a unit in a child on an empty cache, after the units of
its group listed before it, and names what it does not know."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench import unit_compile_seconds

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "unit_compile_seconds.py"


def test_a_unit_is_timed_after_its_groups_earlier_units(monkeypatch):
    told = []

    def run(argv, **kwargs):
        told.append((argv[3:], kwargs["env"]))
        return subprocess.CompletedProcess(argv, 0, '{"gemm": 0.5, "unit": 0.25}\n', "")

    monkeypatch.setattr(unit_compile_seconds.subprocess, "run", run)
    assert unit_compile_seconds.measure("linear.step", 1) == {"gemm": 0.5, "unit": 0.25}
    ((argv, env),) = told
    assert argv == ["linear.step", "linear"]  # the "linear" group before it
    assert env["NUMBA_NUM_THREADS"] == "1"
    assert env["NUMBA_CACHE_DIR"] and not Path(env["NUMBA_CACHE_DIR"]).exists()  # removed


def test_a_child_compiles_on_an_empty_cache():
    found = unit_compile_seconds.measure("embedding", 1)
    assert found["gemm"] > 0 and found["unit"] > 0


@pytest.mark.parametrize("argv", [["--units", "linear,nonsense"], ["--repeat", "0"]])
def test_unknown_units_and_no_repeats_are_one_line(argv):
    command = [sys.executable, str(SCRIPT), *argv]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "unit_compile_seconds" in done.stderr
