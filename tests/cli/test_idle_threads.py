"""The command's bounds on idle thread pools' spinning (`cli.main.quiet_idle_threads`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

#: a threaded SGEMM, then the process's CPU seconds while its main thread sleeps 0.2 s: what
#: OpenBLAS's idle threads burn meanwhile
_IDLE_CPU_AFTER_SGEMM = """
import sys, time
if sys.argv[1] == "quiet":
    from cli.main import quiet_idle_threads
    quiet_idle_threads()
import numpy as np
a = np.ones((1024, 1024), np.float32)
for _ in range(3):
    a @ a
start = time.process_time()
time.sleep(0.2)
print(time.process_time() - start)
"""


def _idle_cpu_after_sgemm(mode: str) -> float:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS")
    }
    result = subprocess.run(
        [sys.executable, "-c", _IDLE_CPU_AFTER_SGEMM, mode],
        capture_output=True, text=True, check=True, cwd=ROOT, env=env,
    )  # fmt: skip
    return float(result.stdout.split()[-1])


def test_openblas_threads_sleep_after_a_call_in_a_command_process():
    spun = _idle_cpu_after_sgemm("default")
    if spun < 0.05:
        pytest.skip(f"OpenBLAS's idle threads spun {spun:.3f} s here (one core, or no threads)")
    quiet = _idle_cpu_after_sgemm("quiet")
    # a woken thread's few scheduler ticks, against the 0.1 s of spinning it does by default
    assert quiet < 0.03, (spun, quiet)


def test_the_command_module_loads_no_numpy_before_it_sets_the_bounds():
    code = "import sys, cli.main; cli.main.build_parser(); print('numpy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split()[-1] == "False"
