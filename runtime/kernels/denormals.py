"""Denormal floats read and written as zero while the kernels run (x86's FTZ and DAZ).

A float32 below 1.2e-38 in magnitude is denormal, and on Intel cores an operation that reads
or makes one takes a microcode assist of about a hundred cycles. Training makes them: seed-lcn
at batch 64 under Adam, its logits grown by the first two steps, has softmax probabilities
that round to nothing, and its third step's gradients below the classifier were 94-98%
denormal (104 of L1's 146 million weight gradients). On an Intel Xeon VM that step took 27.5 s
where its neighbours took 1.4-2.8 s, 23.6 s of it in L1's weight gradient (the AMD EPYC VMs of
the stops before never showed it: Zen cores take most denormals without an assist). Flushed, such a value is
zero, an error below 1.2e-38 per operation, which no tolerance of a float32 computation sees;
it is what TensorFlow's and oneDNN's CPU kernels do.

`flushing_denormals()` sets both bits of MXCSR on the thread that enters it (the executor's,
for a step, and the profiler's; restored as it leaves) and, where the kernels run on more than
one thread, on every thread of Numba's pool, which runs only kernels and keeps the setting. A
job's process (`flushed_job()`) starts the pool flushed: its threads take the setting of the
thread that starts them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

#: MXCSR's flush-to-zero bit: a denormal result is written as zero
FTZ = 1 << 15
#: MXCSR's denormals-are-zero bit: a denormal operand is read as zero
DAZ = 1 << 6
#: iterations per thread of the loop that sets the pool's threads: each gets a share
_PER_THREAD = 16


@intrinsic
def _read_mxcsr(typingctx):
    """This thread's MXCSR (`stmxcsr`)."""

    def codegen(context, builder, signature, args):
        word = cgutils.alloca_once(builder, ir.IntType(32))
        store = builder.module.declare_intrinsic(
            "llvm.x86.sse.stmxcsr",
            fnty=ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
        )
        builder.call(store, [builder.bitcast(word, ir.IntType(8).as_pointer())])
        return builder.load(word)

    return types.uint32(), codegen


@intrinsic
def _write_mxcsr(typingctx, value):
    """Set this thread's MXCSR to `value` (`ldmxcsr`; its low 32 bits)."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = context.cast(builder, args[0], signature.args[0], types.uint32)
        word = cgutils.alloca_once_value(builder, low)
        load = builder.module.declare_intrinsic(
            "llvm.x86.sse.ldmxcsr",
            fnty=ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
        )
        builder.call(load, [builder.bitcast(word, ir.IntType(8).as_pointer())])
        return context.get_dummy_value()

    return types.void(value), codegen


@njit(nogil=True, cache=True)
def _swap_mxcsr(value: int, flush: bool) -> int:
    """This thread's MXCSR, then set to `value`, or with `flush` to itself with FTZ and DAZ
    (one function: each compiled one costs a cold start about 0.1 s)."""
    before = _read_mxcsr()
    _write_mxcsr((before | (FTZ | DAZ)) if flush else value)
    return before


def mxcsr() -> int:
    """The calling thread's MXCSR."""
    before = _swap_mxcsr(0, True)
    _swap_mxcsr(before, False)
    return before


@njit(parallel=True, nogil=True, cache=True)
def _flush_on_every_thread(seen: np.ndarray) -> None:
    for i in prange(seen.size):
        _swap_mxcsr(0, True)
        seen[i] = _read_mxcsr()


_pool = threading.Lock()
_pool_flushed = False


def flush_in_pool() -> np.ndarray:
    """Set FTZ and DAZ on every thread of Numba's pool; each iteration's MXCSR after it."""
    previous = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        seen = np.zeros(numba.config.NUMBA_NUM_THREADS * _PER_THREAD, np.uint32)
        _flush_on_every_thread(seen)
        return seen
    finally:
        numba.set_num_threads(previous)


def _pool_started() -> bool:
    """Whether Numba has started its pool of threads (it does when first asked how many it
    runs, or at the first parallel loop); a Numba that does not say is taken to have."""
    from numba.np.ufunc import parallel

    return getattr(parallel, "_is_initialized", True)


@contextmanager
def flushed_job() -> Iterator[None]:
    """Denormals flushed on this thread while a job runs in this process (`train`, `predict`, a
    rank; restored after), and on Numba's pool where it starts meanwhile: its threads start
    flushed (a new thread takes the setting of the thread that starts it), and no loop over them
    is compiled (0.5 s of a cold start on two threads)."""
    global _pool_flushed
    before = _swap_mxcsr(0, True)
    with _pool:
        unstarted = not _pool_flushed and not _pool_started()
        if unstarted:
            _pool_flushed = True
    try:
        yield
    finally:
        with _pool:
            if unstarted and not _pool_started():  # to start later, from a thread not flushed
                _pool_flushed = False
        _swap_mxcsr(before, False)


@contextmanager
def flushing_denormals() -> Iterator[None]:
    """Denormals flushed on this thread meanwhile, and from now on in Numba's pool where this
    thread runs kernels on more than one thread.

    A pool started inside `flushed_job` started flushed; any other is flushed by a loop over its
    threads, once."""
    global _pool_flushed
    before = _swap_mxcsr(0, True)
    if numba.get_num_threads() > 1:
        with _pool:
            if not _pool_flushed:
                flush_in_pool()
                _pool_flushed = True
    try:
        yield
    finally:
        _swap_mxcsr(before, False)
