"""`bench machine`'s reading of a stream that crossed while a kernel ran."""

from __future__ import annotations

import pytest

from bench.message_costs import stream_crossed


def test_a_stream_held_below_a_message_is_read_as_half_of_one_never_as_standing_still():
    assert stream_crossed(0, 64, 8 << 20) == pytest.approx(4 << 20)
    assert stream_crossed(3, 64, 1 << 20) == pytest.approx(3.5 * (1 << 20))


def test_a_stream_done_within_the_kernel_crossed_whole():
    assert stream_crossed(64, 64, 1 << 20) == 64 << 20
