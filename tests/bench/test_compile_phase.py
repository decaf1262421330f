"""bench/compile_phase.py: a cold run's events read back, its phase timed in the run's own
process, and bad arguments refused in one line."""

import json

import pytest

from bench import compile_phase


def _line(**event):
    return compile_phase.MARK + json.dumps(event)


def test_the_phase_is_the_runs_own_start_to_end_whatever_its_helpers_print():
    stderr = "\n".join(
        [
            "a warning from somewhere",
            _line(what="phase start", pid=10, t=0.5, units=["filterA"]),
            _line(what="unit", pid=11, t=0.9, unit="softmax", seconds=0.3),
            _line(what="phase end", pid=11, t=1.0),  # a helper that had forked at the start
            _line(what="unit", pid=10, t=2.0, unit="filterA", seconds=1.5),
            _line(what="phase end", pid=10, t=2.25),
        ]
    )
    events = compile_phase.events_of(stderr)
    assert [e["what"] for e in events] == ["phase start", "unit", "phase end", "unit", "phase end"]
    assert compile_phase.phase_seconds(events) == pytest.approx(1.75)
    shown = compile_phase.timeline(events).splitlines()
    assert len(shown) == 5 and "filterA (1.50 s)" in shown[3] and "[11]" in shown[1]


@pytest.mark.parametrize(
    ("argv", "named"), [(["--trees", "/nonexistent"], "/nonexistent"), (["--repeat", "0"], "")]
)
def test_bad_arguments_are_one_line_and_exit_2(argv, named, capsys):
    assert compile_phase.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compile_phase:") and named in err[0]
