"""The cores this process may run on, and whether it may fork copies of itself onto them.

Planning forks (`runtime.step.foresight`, whose processes work out plans and place memory),
training sizes its thread pools and compile helpers (`runtime.launch`), all from these.
"""

from __future__ import annotations

import multiprocessing
import os
import threading


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def spare_cores() -> int:
    """The cores this process may run on beyond the one it runs on."""
    return max(host_cores() - 1, 0)


def can_fork() -> bool:
    """Whether a copy of this process may be forked to work jobs out: the platform forks and
    no other thread runs (a forked copy of another thread's locks may be held forever)."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
