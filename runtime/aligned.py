"""Placed arrays: the buffers the runtime computes in start at a chosen cache line of a page.

Where a buffer starts within its page changes how fast the kernels run over it. With
seed-lcn-small's L1 weight-gradient piece (five buffers of 0.4-1.3 MB), the same kernel on the same
values took 2.4-3.4 ms with the buffers at the offsets the heap gave five fresh copies, and 1.5-2.1
ms with each at the start of a page or at any cache-line offset from one. The heap's offsets depend
on what was allocated and freed before (glibc serves arrays below its moving mmap threshold from
the heap), so a run's speed varied with its allocation history. Placing each buffer takes that out.
Successive buffers start at successive "colours" (cache-line offsets 17 lines apart, modulo the
page), not all at the page start: the runtime's streaming passes read two buffers and write a
third, and buffers at the same offset in their pages would contend for the same cache sets and
alias in the core's store-to-load checks (4K aliasing).

A kernel's own temporaries (the weight gradient's batch-major copy of its input, a linear
product's rows of b copied wider) are taken from a buffer the thread keeps for them
(`scratch_empty`): glibc maps an allocation past its mmap threshold (at most 32 MiB) afresh and
returns it on free, so a temporary that large was faulted in again on every call (the seed's L1
weight gradient at batch 256: a 71 MB copy, 563 page faults and 19 ms of system time a call),
where the step's own buffers are placed once a run.
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np

PAGE = 4096
LINE = 64
_COLOUR_STEP = 17  # coprime with the 64 lines of a page: every colour before any repeats
_colours = itertools.count()


def _aligned(shape: tuple[int, ...], dtype, allocate) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = allocate(nbytes + 2 * PAGE, np.uint8)
    offset = next(_colours) * _COLOUR_STEP * LINE % PAGE
    start = -raw.ctypes.data % PAGE + offset
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """`np.empty(shape, dtype)`, placed at the next colour."""
    return _aligned(tuple(shape), dtype, np.empty)


def aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """`np.zeros(shape, dtype)`, placed at the next colour (pages are zeroed on first touch)."""
    return _aligned(tuple(shape), dtype, np.zeros)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `array`, placed at the next colour."""
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


#: per thread, a kernel temporary's kept bytes by purpose (`scratch_empty`)
_kept = threading.local()


def scratch_empty(purpose: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised placed array of `shape` for a kernel's temporary: the calling thread's
    buffer for `purpose`, grown to the largest asked for and kept, so that its pages are touched
    once a run rather than once a call (see the module docstring). The array is the caller's
    until its next call for the same purpose on the same thread: a temporary must not outlive
    the kernel call that asks for it."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffers = getattr(_kept, "buffers", None)
    if buffers is None:
        buffers = _kept.buffers = {}
    found = buffers.get(purpose)
    if found is None or found.nbytes < nbytes:
        found = buffers[purpose] = _aligned((max(nbytes, 1),), np.uint8, np.empty)
    return found[:nbytes].view(dtype).reshape(shape)
