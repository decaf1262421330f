"""Placed arrays and a kernel's kept temporaries (`runtime.aligned`)."""

import threading

import numpy as np

from runtime.aligned import LINE, aligned_empty, scratch_empty


def test_placed_arrays_start_on_a_cache_line_at_successive_colours():
    first, second = (aligned_empty((5, 7), np.float32) for _ in range(2))
    assert first.ctypes.data % LINE == 0 and second.ctypes.data % LINE == 0
    assert first.ctypes.data % 4096 != second.ctypes.data % 4096


def test_a_temporary_is_the_threads_kept_buffer_grown_to_the_largest_asked_for():
    large = scratch_empty("test temporary", (64, 33), np.float32)
    assert large.shape == (64, 33) and large.dtype == np.float32
    assert large.flags.c_contiguous and large.ctypes.data % LINE == 0
    smaller = scratch_empty("test temporary", (3, 5), np.float64)
    assert smaller.ctypes.data == large.ctypes.data  # the same pages: touched once a run
    larger = scratch_empty("test temporary", (65, 33), np.float32)
    assert larger.shape == (65, 33) and larger.ctypes.data % LINE == 0
    assert scratch_empty("test temporary", (64, 33), np.float32).ctypes.data == larger.ctypes.data
    other = scratch_empty("another test temporary", (64, 33), np.float32)
    assert not np.shares_memory(other, larger)


def test_each_thread_keeps_its_own_temporaries():
    mine = scratch_empty("test temporary", (128,), np.float64)
    theirs = []
    thread = threading.Thread(
        target=lambda: theirs.append(scratch_empty("test temporary", (128,), np.float64))
    )
    thread.start()
    thread.join()
    assert not np.shares_memory(mine, theirs[0])


def test_an_empty_temporary_is_an_empty_array():
    assert scratch_empty("test temporary", (0, 4), np.float32).shape == (0, 4)
