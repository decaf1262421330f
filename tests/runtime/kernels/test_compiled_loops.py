"""Every kernel loop is compiled: a function of `runtime.kernels` whose body runs a `prange` loop
is a Numba dispatcher, or a `ThreadedKernel` of two (parallel and plain loops), never plain
Python (which would compute the same values a thousand times slower, and no value test could
tell)."""

import ast
import importlib
import pkgutil
from pathlib import Path

from numba.core.registry import CPUDispatcher

import runtime.kernels
from runtime.kernels.threaded import ThreadedKernel

ROOT = Path(runtime.kernels.__file__).parent


def _functions_with_prange() -> list[tuple[str, str]]:
    found = []
    for path in sorted(ROOT.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id == "prange"
                for call in ast.walk(node)
            ):
                found.append((path.stem, node.name))
    return found


def test_every_function_with_a_parallel_loop_is_compiled():
    found = _functions_with_prange()
    assert len(found) > 10  # the filters', updates', GELU's, attention's loops among them
    names = {info.name for info in pkgutil.iter_modules(runtime.kernels.__path__)}
    for module, function in found:
        assert module in names
        kernel = getattr(importlib.import_module(f"runtime.kernels.{module}"), function)
        where = f"runtime.kernels.{module}.{function}"
        if isinstance(kernel, ThreadedKernel):
            assert isinstance(kernel.parallel, CPUDispatcher), where
            assert isinstance(kernel.serial, CPUDispatcher), where
            assert kernel.parallel.targetoptions.get("parallel"), where
            assert not kernel.serial.targetoptions.get("parallel"), where
        else:
            assert isinstance(kernel, CPUDispatcher), where
