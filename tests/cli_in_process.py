"""`legion-nn ARGS` run in the test's own process: its exit status and what it printed, as a
`subprocess.CompletedProcess`, without the second of interpreter start and imports a child
costs (the suite runs a few hundred of them)."""

from __future__ import annotations

import contextlib
import io
import subprocess

from cli.main import main


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["legion-nn", *args], code, out.getvalue(), err.getvalue())
