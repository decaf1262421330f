"""Training progress that fits where it goes.

On a terminal, tqdm's bar, redrawn in place. On a pipe or a file (under `mpiexec`, whose launcher
forwards every rank's output through pipes, or a batch scheduler's log), a bar's carriage
returns would leave every redraw in the log, so a plain line goes out instead at most every
`LINE_SECONDS` and after the last step: the step, the loss, the rate since the last line and the
time left at that rate.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: seconds between two progress lines on a pipe or a file
LINE_SECONDS = 10.0


def _duration(seconds: float) -> str:
    seconds = max(round(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """Steps as they end (`step`), and lines between them (`write`, to stdout)."""

    def __init__(
        self,
        disable: bool,
        stream: TextIO | None = None,
        interval: float = LINE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.disable = disable
        self.interval = interval
        self.clock = clock
        self.total: int | None = None
        self.bar = None
        if not disable and self.stream.isatty():
            from tqdm import tqdm

            # without tqdm's monitor thread (it only loosens `miniters` for a bar updated
            # rarely), so that a run may still fork its compile helpers (`cores.can_fork`)
            bar = type("Bar", (tqdm,), {"monitor_interval": 0})
            self.bar = bar(total=None, unit="step", file=self.stream)
        self.done = 0
        self._last: tuple[float, int] | None = None  # (time, steps done) of the last line

    def start(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
        self._last = (self.clock(), 0)

    def step(self, loss: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
            return
        if self.disable or self._last is None:
            return
        now = self.clock()
        since, steps = self._last
        if now - since < self.interval and self.done != self.total:
            return
        rate = (self.done - steps) / max(now - since, 1e-9)
        of = f"/{self.total}" if self.total else ""
        line = f"step {self.done}{of}: loss {loss:.4f}, {rate:.3g} steps/s"
        if self.total:
            line += f", {_duration((self.total - self.done) / rate)} left"
        print(line, file=self.stream, flush=True)
        self._last = (now, self.done)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
