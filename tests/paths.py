"""Where the tests find the repository and their inputs, wherever a test module sits."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
#: inputs every command must refuse in one line (`tests/cli/test_fail_inputs.py`)
FAIL = ROOT / "tests" / "fail"
