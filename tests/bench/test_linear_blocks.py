"""`bench/linear_blocks.py` times each linear pass under both values of a setting, alternated,
and leaves the module's setting as it found it."""

import numpy as np
import pytest

from bench import linear_blocks
from runtime.kernels import linear


@pytest.mark.parametrize("setting", sorted(linear_blocks.SETTINGS))
def test_each_pass_is_timed_under_both_values_and_the_setting_restored(setting):
    name, values = linear_blocks.SETTINGS[setting]
    before = getattr(linear, name) if name else None
    passes = linear_blocks.passes(8, 48, 24, setting)
    expected = (
        {"input grad"}
        if setting == "transposed"
        else {"forward", "input grad", "weight grad", "wgrad + adam"}
    )
    assert set(passes) == expected
    for call in passes.values():
        found = linear_blocks.side_by_side(call, setting, 1)
        assert set(found) == set(values)
        assert all(np.isfinite(t) and t > 0 for t in found.values())
    if name:
        assert getattr(linear, name) == before


def test_the_packed_setting_reaches_both_kernels(monkeypatch):
    """Off never packs; on packs where `_packs` says to (here, its rule loosened, every b)."""
    monkeypatch.setattr(linear, "PACKED_STRIDE_BYTES", 4)
    monkeypatch.setitem(
        linear_blocks.SETTINGS, "packed", ("PACKED_LEAST_BYTES", (linear_blocks.NEVER, 0))
    )
    called = []
    for kernel in ("_tiled_product", "_packed_product"):
        original = getattr(linear, kernel)
        monkeypatch.setattr(
            linear, kernel, lambda *a, k=kernel, f=original: called.append(k) or f(*a)
        )
    call = linear_blocks.passes(8, 48, 24, "packed")["input grad"]
    linear_blocks.side_by_side(call, "packed", 1)
    assert {"_tiled_product", "_packed_product"} <= set(called)
