"""Running a test's body in a new interpreter, for what needs a process without other threads.

`runtime.step.foresight` forks only from a process that runs no thread but its own (a fork copies
another thread's locks as they are, held or not). A test worker may hold threads an earlier test
left (a progress bar's monitor, a transport's), so a test of what forks runs its body in a
spawned interpreter, which starts with one thread; its assertions fail there and are raised here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` (a module-level function, and its arguments, that pickle) in a newly
    spawned interpreter, which may fork processes of its own: its value, or its exception
    raised here."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_run, args=(function, args, sender))
    process.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except EOFError:
        raise AssertionError(f"{function.__name__} ended its process without an answer") from None
    finally:
        process.join()
        receiver.close()
    if not ok:
        raise value
    return value


def _run(function: Callable[..., Any], args: tuple, sender) -> None:
    try:
        sender.send((True, function(*args)))
    except BaseException as exc:  # noqa: BLE001  (raised again in the test's own process)
        sender.send((False, exc))
