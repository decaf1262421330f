"""Denormal floats read and written as zero while the kernels run (x86's FTZ and DAZ).

A float32 below 1.2e-38 in magnitude is denormal, and on Intel cores an operation that reads
or makes one takes a microcode assist of about a hundred cycles. Training makes them: seed-lcn
at batch 64 under Adam, its logits grown by the first two steps, has softmax probabilities
that round to nothing, and its third step's gradients below the classifier were 94-98%
denormal (104 of L1's 146 million weight gradients). On an Intel Xeon VM that step took 27.5 s
where its neighbours took 1.4-2.8 s, 23.6 s of it in L1's weight gradient; AMD's cores take
denormals at full speed, which is why the VMs before never showed it. Flushed, such a value is
zero, an error below 1.2e-38 per operation, which no tolerance of a float32 computation sees;
it is what TensorFlow's and oneDNN's CPU kernels do.

`flushing_denormals()` sets both bits of MXCSR on the thread that enters it (the executor's,
for a step; restored as it leaves) and, once per process, on every thread of Numba's pool, which
runs only kernels (the pool's threads keep it). A thread the pool starts later starts from its
creator's setting, the entering thread's.
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
def mxcsr() -> int:
    """The calling thread's MXCSR."""
    return _read_mxcsr()


@njit(nogil=True, cache=True)
def set_mxcsr(value: int) -> None:
    _write_mxcsr(value)


@njit(nogil=True, cache=True)
def _flush_on_this_thread() -> np.uint32:
    _write_mxcsr(_read_mxcsr() | (FTZ | DAZ))
    return _read_mxcsr()


@njit(parallel=True, nogil=True, cache=True)
def _flush_on_every_thread(seen: np.ndarray) -> None:
    for i in prange(seen.size):
        seen[i] = _flush_on_this_thread()


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


@contextmanager
def flushing_denormals() -> Iterator[None]:
    """Denormals flushed on this thread meanwhile, and from now on in Numba's pool."""
    global _pool_flushed
    before = mxcsr()  # the pool's loop runs on this thread too
    with _pool:
        if not _pool_flushed:
            flush_in_pool()
            _pool_flushed = True
    _flush_on_this_thread()
    try:
        yield
    finally:
        set_mxcsr(before)
