"""Training progress on a terminal and on a pipe (`cli.commands.progress`)."""

from __future__ import annotations

import io
import subprocess
import sys

from cli.commands.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pipe_gets_a_plain_line_every_interval_and_after_the_last_step():
    out, clock = io.StringIO(), Clock()
    progress = Progress(False, out, interval=10.0, clock=clock)
    progress.start(100)
    for step in range(100):
        clock.now += 0.5  # two steps a second
        progress.step(1.0 / (step + 1))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # a line every 10 s (20 steps), and the last step's
    assert [line.split(":")[0] for line in lines] == [
        f"step {n}/100" for n in (20, 40, 60, 80, 100)
    ]
    assert lines[0] == "step 20/100: loss 0.0500, 2 steps/s, 0:40 left"
    assert lines[-1].endswith("0:00 left")


def test_a_terminal_gets_the_bar_and_no_lines():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(False, out)
    progress.start(3)
    for _ in range(3):
        progress.step(0.5)
    progress.close()
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()
    assert "steps/s," not in out.getvalue()


def test_disabled_progress_says_nothing():
    out = io.StringIO()
    progress = Progress(True, out, interval=0.0)
    progress.start(5)
    for _ in range(5):
        progress.step(0.1)
    assert out.getvalue() == ""


def test_train_under_a_pipe_writes_lines_not_a_bar(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cli", "train", "--data", "synthetic", "--steps", "3"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert "step 3/3: loss " in result.stderr
