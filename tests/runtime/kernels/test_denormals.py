"""`runtime.kernels.denormals`: denormal floats flushed to zero on every thread a step's kernels
run on, and the caller's setting back after."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from legion_nn.networks import load_network
from runtime import rank_step
from runtime.adapters import StepContext
from runtime.kernels import denormals
from runtime.rank_executor import one_process
from tests.fresh_process import in_fresh_process

FLUSHED = denormals.FTZ | denormals.DAZ
#: a float32 denormal: below float32's smallest normal, 1.18e-38
TINY = np.float32(1e-40)


@njit(parallel=True, nogil=True)
def _scaled_on_threads(values: np.ndarray, out: np.ndarray, threads: np.ndarray) -> None:
    for i in prange(values.size):
        out[i] = values[i] * np.float32(3.0)
        threads[i] = numba.get_thread_id()


def _scaled(values):
    out = np.empty_like(values)
    threads = np.empty(values.size, np.int64)
    _scaled_on_threads(values, out, threads)
    return out, threads


def test_denormals_read_and_written_as_zero_on_every_thread_then_the_callers_setting_back():
    assert TINY != 0 and abs(TINY) < np.finfo(np.float32).tiny
    values = np.full(4096, TINY, np.float32)
    _scaled(values)  # the pool started before: a loop over its threads sets them
    before = denormals.mxcsr()
    with denormals.flushing_denormals():
        assert denormals.mxcsr() & FLUSHED == FLUSHED
        out, threads = _scaled(values)
        assert not out.any()  # read as zero on every thread of the pool
        assert len(set(threads.tolist())) == numba.get_num_threads()
        # and a normal result too small to be one is written as zero (FTZ)
        small = np.full(8, np.finfo(np.float32).tiny, np.float32)
        assert not (small * np.float32(0.25)).any()
    assert denormals.mxcsr() == before
    # this thread computes with denormals again as it did
    np.testing.assert_array_equal(values * np.float32(3.0), np.full(4096, TINY * np.float32(3.0)))


def _a_pool_started_in_a_job_starts_flushed() -> list[bool]:
    denormals.flush_in_pool = lambda: pytest.fail("the pool was flushed by a loop")
    values = np.full(4096, TINY, np.float32)
    flushed = []
    with denormals.flushed_job():  # as `train` runs, before anything starts the pool
        assert denormals.mxcsr() & FLUSHED == FLUSHED
        numba.set_num_threads(2)  # starts the pool
        for _ in range(2):
            with denormals.flushing_denormals():
                out, threads = _scaled(values)
                flushed.append(not out.any() and len(set(threads.tolist())) == 2)
    out, _ = _scaled(values)  # the pool's threads keep it; this thread has its own back
    flushed.append(not out[-1] and denormals.mxcsr() & FLUSHED == 0)
    return flushed


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="a pool of one thread")
def test_a_job_process_starts_numbas_pool_flushed():
    assert in_fresh_process(_a_pool_started_in_a_job_starts_flushed) == [True] * 3


def test_every_task_of_a_step_runs_with_denormals_flushed(monkeypatch):
    network = load_network("seed-lcn-small")
    graph = network.lower(batch=4, optimizer="adam")
    seen = []
    real_task = rank_step.StepRun.task

    def task(self, rank_task):
        seen.append(denormals.mxcsr())
        return real_task(self, rank_task)

    monkeypatch.setattr(rank_step.StepRun, "task", task)
    before = denormals.mxcsr()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *network.input)).astype(np.float32)
    labels = rng.integers(0, network.classes, 4)
    one_process().run(graph, StepContext(0, inputs=x, labels=labels))
    assert len(seen) == len(graph.tasks)
    assert all(value & FLUSHED == FLUSHED for value in seen)
    assert denormals.mxcsr() == before
