"""Imports point one way: legion_nn <- partitioner <- runtime <- bench; visualize may use the
first two. The benchmarks (`bench`) may use everything and nothing but the CLI uses them.

Only runtime's MPI executor imports mpi4py; kernels import no graph or MPI code. The CLI's
sub-commands may reach further, but only lazily, inside functions.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("legion_nn", "partitioner", "runtime", "visualize", "bench")
FORBIDDEN = {
    "legion_nn": {"partitioner", "runtime", "visualize", "bench", "mpi4py"},
    "partitioner": {"runtime", "visualize", "bench", "mpi4py"},
    "visualize": {"runtime", "bench", "mpi4py"},
    "runtime": {"visualize", "bench"},
    "bench": {"mpi4py"},
}


def top_level_imports(path):
    """Modules imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        for sub in (
            ast.walk(node)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            else []
        ):
            if isinstance(sub, ast.Import):
                found += [alias.name for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.append(sub.module)
    return found


def all_imports(path):
    tree = ast.parse(path.read_text())
    found = []
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Import):
            found += [alias.name for alias in sub.names]
        elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
            found.append(sub.module)
    return found


def modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


@pytest.mark.parametrize("package, path", list(modules()), ids=lambda v: str(v).split("/")[-1])
def test_import_direction(package, path):
    for name in top_level_imports(path):
        assert name.split(".")[0] not in FORBIDDEN[package], (
            f"{path.relative_to(ROOT)} imports {name}"
        )


def test_only_the_mpi_executor_imports_mpi4py():
    for package, path in modules():
        if "mpi4py" in [name.split(".")[0] for name in all_imports(path)]:
            assert path.relative_to(ROOT).as_posix() == "runtime/mpi_executor.py", path


def test_kernels_import_no_graph_or_mpi_code():
    for path in (ROOT / "runtime" / "kernels").rglob("*.py"):
        for name in all_imports(path):
            assert name.split(".")[0] not in {"legion_nn", "partitioner", "mpi4py", "visualize"}, (
                f"{path.relative_to(ROOT)} imports {name}"
            )


def test_commands_import_heavier_packages_lazily():
    for path in (ROOT / "legion_nn").rglob("*.py"):
        for name in top_level_imports(path):
            assert name.split(".")[0] not in {
                "partitioner",
                "runtime",
                "visualize",
                "matplotlib",
                "numba",
            }, f"{path.relative_to(ROOT)} imports {name} at module level"


def test_importing_the_packages_changes_no_environment():
    code = (
        "import os, importlib, pkgutil; before = dict(os.environ)\n"
        "import legion_nn, partitioner, runtime, runtime.kernels, visualize, bench\n"
        "for package in (legion_nn, partitioner, runtime, visualize, bench):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if info.name != 'runtime.mpi_executor':  # MPI_Init on import: a launcher's job\n"
        "            importlib.import_module(info.name)\n"
        "changed = sorted(k for k in set(os.environ) | set(before)\n"
        "                 if os.environ.get(k) != before.get(k))\n"
        "assert not changed, changed\n"
    )
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
