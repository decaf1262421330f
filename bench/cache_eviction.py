"""Operands out of the caches before a timed kernel runs, as a step's other tasks leave them.

Three ways (`EVICTIONS`), chosen by `EVICTION` (`evicting` sets it for a while):

- "write" (the default): write twice the last-level cache. It costs the cache's bytes whatever
  the piece: on a VM with a 300 MiB L3 (Emerald Rapids), 68 ms an eviction, 95 of the 105 s
  `bench machine --quick` took to profile seed-lcn-small at batch 8.
- "flush": `clflushopt` each of the piece's operands' lines (CPUs from Skylake and Zen on). It
  costs the operands' bytes: on the same VM the same pieces profiled in 0.8 s where the write
  took 136 s. It leaves cold only what the piece reads and writes, not the interpreter's and
  the kernels' own state, so a small piece reads faster: seed-lcn-small's pieces at batch 64
  summed to 0.52 of their times after the write (a piece's median 0.31, from 0.03 to 0.77),
  deep-mlp's at batch 128 to 0.82 (its large pieces' 0.9-1.03), warm ("none") 0.39 and 0.72
  (`bench/cache_evictions.py`). Which of the two a step resembles more depends on the
  network: the traced steps over the profiles (`bench/step_factor.py`) spread 0.90-1.27 after
  the flush and 0.46-0.83 after the write for seed-lcn-small's plans on 1 and 2 ranks, and
  0.69-1.05 against 0.82-0.95 for deep-mlp's. The cost model's factor was fitted and its
  predictions checked after the write, so the write stays the default.
- "none": warm caches, as the piece's earlier runs left them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from bench.machine_facts import cpu_flags, last_level_cache_bytes
from legion_nn.errors import LegionNNError

#: what a "write" eviction writes, in last-level caches: enough that little of what was there stays
EVICTED_CACHES = 2
#: bytes a flushed line covers (every x86-64 CPU's cache line)
LINE = 64
#: the ways `evict` may take (the module's docstring)
EVICTIONS = ("write", "flush", "none")


#: how `evict` takes operands out of the caches
EVICTION = "write"


def can_flush() -> bool:
    """Whether this CPU has `clflushopt` ("flush" needs it)."""
    return "clflushopt" in cpu_flags()


def available_evictions() -> list[str]:
    """The `EVICTIONS` this CPU can do."""
    return [e for e in EVICTIONS if e != "flush" or can_flush()]


def cheapest_cold() -> str:
    """The eviction that leaves a piece's operands cold at the least cost on this CPU."""
    return "flush" if can_flush() else "write"


def check_eviction(eviction: str) -> None:
    """A `LegionNNError` where `eviction` is none of `EVICTIONS` or this CPU cannot do it."""
    if eviction not in EVICTIONS:
        raise LegionNNError(f"--eviction: {eviction!r} is not one of {', '.join(EVICTIONS)}")
    if eviction == "flush" and not can_flush():
        raise LegionNNError("--eviction flush: this CPU has no clflushopt")


@contextmanager
def evicting(eviction: str) -> Iterator[None]:
    """`evict` by `eviction` meanwhile (checked by `check_eviction`)."""
    global EVICTION
    check_eviction(eviction)
    previous, EVICTION = EVICTION, eviction
    try:
        yield
    finally:
        EVICTION = previous


@intrinsic
def _flush_line(typingctx, address):
    """`clflushopt` of the line holding byte `address`: written back if dirty, then dropped
    from every level of every core's caches."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        flush = builder.module.declare_intrinsic(
            "llvm.x86.clflushopt", fnty=ir.FunctionType(ir.VoidType(), [byte_pointer])
        )
        builder.call(flush, [builder.inttoptr(args[0], byte_pointer)])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def _fence(typingctx):
    """`mfence`: the flushes before it are done before anything after it reads memory."""

    def codegen(context, builder, signature, args):
        fence = builder.module.declare_intrinsic(
            "llvm.x86.sse2.mfence", fnty=ir.FunctionType(ir.VoidType(), [])
        )
        builder.call(fence, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True)
def flush_lines(spans: np.ndarray) -> None:
    """Flush every line of each [low, high) byte span (rows of `spans`), then fence."""
    for row in range(spans.shape[0]):
        low, high = spans[row, 0], spans[row, 1]
        for address in range(low - low % LINE, high, LINE):
            _flush_line(address)
    _fence()


@njit(parallel=True, nogil=True, cache=True)
def _write_all(buffer: np.ndarray) -> None:
    for i in prange(buffer.shape[0]):
        buffer[i] += 1.0


@functools.cache
def eviction_buffer(caches: int) -> np.ndarray:
    return np.zeros(caches * last_level_cache_bytes() // 8)


def byte_spans(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """The [low, high) bytes each non-empty array's elements lie in, one row each."""
    spans = [np.lib.array_utils.byte_bounds(a) for a in arrays if a.size]
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def evict(operands: Iterable[np.ndarray]) -> None:
    """Take `operands` out of the caches as `EVICTION` says: flush their lines, or write
    `EVICTED_CACHES` times the last-level cache on the Numba threads the kernels run on (each
    core's own caches, and the shared one), or nothing."""
    if EVICTION == "flush":
        flush_lines(byte_spans(operands))
    elif EVICTION == "write":
        _write_all(eviction_buffer(EVICTED_CACHES))
