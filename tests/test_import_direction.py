"""Imports point one way: legion_nn <- partitioner <- runtime; visualize may use the first two;
the command line (`cli`) and the benchmarks (`bench`) sit on top and may use everything, and no
package imports them (the command line's `bench` sub-command alone runs the benchmarks). Every
import counts, those inside functions too: there is no exception.

Only runtime's MPI transport imports mpi4py; kernels import no graph or MPI code. The command
line imports the heavier packages inside its functions, so that `legion-nn --help` and a bad
option answer fast.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("legion_nn", "partitioner", "runtime", "visualize", "bench", "cli")
FORBIDDEN = {
    "legion_nn": {"partitioner", "runtime", "visualize", "bench", "cli", "mpi4py"},
    "partitioner": {"runtime", "visualize", "bench", "cli", "mpi4py"},
    "visualize": {"runtime", "bench", "cli", "mpi4py"},
    "runtime": {"visualize", "bench", "cli"},
    "bench": {"cli", "mpi4py"},
    "cli": {"mpi4py"},
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
    for name in all_imports(path):
        assert name.split(".")[0] not in FORBIDDEN[package], (
            f"{path.relative_to(ROOT)} imports {name}"
        )


def test_the_direction_check_reads_imports_inside_functions(tmp_path):
    module = tmp_path / "late.py"
    module.write_text("def run():\n    from runtime.training import Trainer\n")
    assert "runtime.training" in all_imports(module)
    assert "runtime.training" not in top_level_imports(module)


def test_only_the_mpi_transport_imports_mpi4py():
    for package, path in modules():
        if "mpi4py" in [name.split(".")[0] for name in all_imports(path)]:
            assert path.relative_to(ROOT).as_posix() == "runtime/mpi_transport.py", path


def test_kernels_import_no_graph_or_mpi_code():
    for path in (ROOT / "runtime" / "kernels").rglob("*.py"):
        for name in all_imports(path):
            assert name.split(".")[0] not in {"legion_nn", "partitioner", "mpi4py", "visualize"}, (
                f"{path.relative_to(ROOT)} imports {name}"
            )


def test_commands_import_heavier_packages_lazily():
    for path in (ROOT / "cli").rglob("*.py"):
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
        "import legion_nn, partitioner, runtime, runtime.kernels, visualize, bench, cli\n"
        "for package in (legion_nn, partitioner, runtime, visualize, bench, cli):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        # MPI_Init on import is a launcher's job; cli.__main__ runs the command\n"
        "        if info.name not in ('runtime.mpi_transport', 'cli.__main__'):\n"
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


def _import_graph() -> dict[str, set[str]]:
    """Every import between the project's modules, function-level and TYPE_CHECKING ones too."""
    paths = {}
    for _, path in modules():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for target in all_imports(path):
            if target in paths and target != name:
                edges[name].add(target)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in paths:
                        edges[name].add(f"{node.module}.{alias.name}")
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start, targets in edges.items():
        if start in index:
            continue
        work = [(start, iter(sorted(targets)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(edges[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_cycle():
    cycles = [sorted(c) for c in _cycles(_import_graph())]
    assert not cycles, cycles
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_planning_a_step_that_is_only_summed_loads_no_numba(tmp_path):
    """`partition` of a plan whose ranks all differ, beyond the programs a simulation builds
    one by one (vgg19's spatial plan on 16384 ranks: its uneven cuts tell every rank apart, and
    every one of its 16384 ranks has a part in some of its 216 tasks, 2.9 million pairs of work,
    past `SIMULATE_EVERY_RANK_MAX_WORK`), sums the step and counts the memory held: no kernel,
    no compiled loop, so Numba's import (a fifth of a second) is not paid."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"main(['partition', 'vgg19', '--ranks', '16384', '--strategy', 'spatial', '--json', "
        f"{str(tmp_path / 'plan.json')!r}])\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"step_model": "bulk-synchronous"' in (tmp_path / "plan.json").read_text()


def test_the_storage_orders_packed_axes_are_the_kernels():
    from runtime.instances import PACKED_FROM_LOGICAL
    from runtime.kernels.layout import WEIGHT_AXES

    assert PACKED_FROM_LOGICAL == WEIGHT_AXES
