"""`bench/linear_passes.py` times every linear pass at a shape, ours beside NumPy's BLAS, from
the tree it is told, and refuses a shape or tree it cannot run in one line."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "linear_passes.py"


def run(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *argv]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)


def test_every_pass_is_timed_beside_blas_where_blas_has_it():
    done = run("--rows", "16", "--inputs", "96", "--outputs", "40", "--repeat", "1",
               "--tree", str(ROOT))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {line[:24].strip(): line[24:].split() for line in done.stdout.splitlines()[4:]}
    assert set(rows) == {"forward", "input grad", "weight grad", "weight grad + adam",
                         "weight grad, then adam"}  # fmt: skip
    for name, cells in rows.items():
        assert float(cells[0]) > 0 and cells[1].endswith("%")
        assert len(cells) == (2 if "adam" in name else 4)
    assert f"tree {ROOT}" in done.stdout


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--tree", "/nonexistent"]])
def test_a_shape_or_tree_it_cannot_run_is_one_line(argv):
    done = run(*argv)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "linear_passes" in done.stderr
