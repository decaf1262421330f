"""`bench.task_profile`: a plan's pieces run with the runtime's kernels, summed per rank."""

from __future__ import annotations

from collections import defaultdict

import numba
import numpy as np
import pytest

from bench import cache_eviction, machine_facts, task_profile
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.aligned import LINE, aligned_copy, aligned_empty, aligned_zeros


@pytest.fixture(scope="module")
def small():
    graph = load_network("seed-lcn-small").lower(batch=6, optimizer="sgd")
    return graph, task_profile.sample_step(graph)


def test_the_busiest_rank_sums_its_pieces_and_each_shape_is_timed_once(small, monkeypatch):
    graph, sample = small
    plan = build_plan(graph, builtin(graph, "spatial", 3), 3)
    timed = []

    def volume(graph, task, piece, executor, ctx):
        timed.append((task.name, piece.rect))
        return float(piece.rect.volume)

    monkeypatch.setattr(task_profile, "_time_piece", volume)
    cache: dict = {}
    profiled = task_profile.profile_plan(graph, plan, 1, sample, cache)
    for task, task_plan in zip(graph.tasks, plan.tasks):
        per_rank: dict[int, float] = defaultdict(float)
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                per_rank[rank] += piece.rect.volume
        assert profiled[task.name] == max(per_rank.values(), default=0.0)
    assert len(timed) == len(cache) < sum(len(t.pieces) for t in plan.tasks)
    # a second plan with the same pieces times nothing again
    task_profile.profile_plan(graph, plan, 1, sample, cache)
    assert len(timed) == len(cache)


def test_profiling_runs_every_piece_and_leaves_the_sample_as_it_was(small):
    graph, (executor, ctx) = small
    before = {name: array.copy() for name, array in executor.arrays.items()}
    plan = build_plan(graph, builtin(graph, "model", 2), 2)
    with cache_eviction.evicting(cache_eviction.cheapest_cold()):  # what is timed is not checked
        profiled = task_profile.profile_plan(graph, plan, 1, (executor, ctx))
    assert list(profiled) == [task.name for task in graph.tasks]
    assert all(seconds > 0 for seconds in profiled.values())
    for name, array in executor.arrays.items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)


def test_placed_arrays_start_on_distinct_cache_lines():
    arrays = [aligned_zeros((5, 7), np.float32) for _ in range(4)]
    offsets = [a.ctypes.data % 4096 for a in arrays]
    assert all(offset % LINE == 0 for offset in offsets)
    assert len(set(offsets)) == len(offsets)
    assert all(a.shape == (5, 7) and a.dtype == np.float32 and not a.any() for a in arrays)
    source = np.arange(12.0).reshape(3, 4)[:, ::2]
    copy = aligned_copy(source)
    assert copy.flags.c_contiguous and copy.ctypes.data % LINE == 0
    np.testing.assert_array_equal(copy, source)
    assert aligned_empty((0, 3), np.float64).shape == (0, 3)


def test_each_timed_run_of_a_piece_starts_with_its_operands_evicted(small, monkeypatch):
    graph, sample = small
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    events = []
    monkeypatch.setattr(
        cache_eviction, "evict", lambda operands: events.append(("evict", list(operands)))
    )
    real_run = task_profile.run_on_views

    def run(task, rect, requirements, views, tensors, ctx):
        events.append(("run", [*views.values(), *(ctx.steps or {}).values()]))
        return real_run(task, rect, requirements, views, tensors, ctx)

    monkeypatch.setattr(task_profile, "run_on_views", run)
    cache: dict = {}
    task_profile.profile_as_run(graph, plan, 1, sample, cache)
    assert len(cache) > 0
    assert [kind for kind, _ in events] == ["evict", "run"] * (task_profile.REPEAT + 1) * len(cache)
    stepped = 0
    for (_, evicted), (_, used) in zip(events[::2], events[1::2]):
        evicted_ids = {id(a) for a in evicted}
        for operand in used:
            if isinstance(operand, np.ndarray):  # every array the kernel reads or writes
                assert operand.size == 0 or id(operand) in evicted_ids
            else:  # a fused optimizer's step: the parameter and its state it steps
                stepped += 1
                arrays = [operand.params, *operand.state]
                assert all(id(a) in evicted_ids for a in arrays if a.size)
    assert stepped > 0  # the one-rank step fuses updates into its weight gradients


def test_the_write_eviction_writes_every_byte_of_twice_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(cache_eviction, "EVICTION", "write")
    buffer = cache_eviction.eviction_buffer(cache_eviction.EVICTED_CACHES)
    assert buffer.nbytes >= cache_eviction.EVICTED_CACHES * machine_facts.last_level_cache_bytes()
    before = buffer.copy()
    cache_eviction.evict([np.ones(3)])
    np.testing.assert_array_equal(buffer, before + 1.0)


def test_the_flush_covers_each_operands_bytes_and_leaves_their_values():
    whole = np.arange(24.0).reshape(4, 6)
    low = whole.ctypes.data
    spans = cache_eviction.byte_spans([whole, whole[1:3, ::2], np.zeros((0, 5)), whole[::-1]])
    # an empty array has nothing to flush; a reversed view covers what its base does
    assert spans.tolist() == [[low, low + 192], [low + 48, low + 136], [low, low + 192]]
    before = whole.copy()
    cache_eviction.flush_lines(spans)  # a dirty line is written back, not lost
    np.testing.assert_array_equal(whole, before)


@pytest.mark.skipif(
    "clflushopt" not in machine_facts.cpu_flags(), reason="the CPU has no clflushopt"
)
def test_the_flush_is_a_clflushopt_per_line_then_a_fence():
    # compiled here: a dispatcher loaded from Numba's cache keeps no assembly
    fresh = numba.njit(nogil=True)(cache_eviction.flush_lines.py_func)
    fresh(cache_eviction.byte_spans([np.ones(100)]))
    (assembly,) = fresh.inspect_asm().values()
    assert "clflushopt" in assembly and "mfence" in assembly
    assert cache_eviction.cheapest_cold() == "flush"
    with cache_eviction.evicting("flush"):
        assert cache_eviction.EVICTION == "flush"
    assert cache_eviction.EVICTION == "write"  # the default, back


def test_a_cpu_without_clflushopt_cannot_flush(monkeypatch):
    monkeypatch.setattr(cache_eviction, "cpu_flags", lambda: frozenset({"avx2", "clflush"}))
    assert cache_eviction.cheapest_cold() == "write"
    with pytest.raises(LegionNNError, match="--eviction flush: this CPU has no clflushopt"):
        cache_eviction.check_eviction("flush")
    assert cache_eviction.EVICTION == "write"


def test_no_eviction_touches_neither_the_operands_nor_the_buffer(monkeypatch):
    monkeypatch.setattr(cache_eviction, "EVICTION", "none")
    for name in ("flush_lines", "_write_all"):
        monkeypatch.setattr(cache_eviction, name, lambda *args: pytest.fail("evicted"))
    cache_eviction.evict([np.ones(3)])


def test_each_ranks_profile_sums_its_own_pieces_and_the_busiest_is_the_plans(small, monkeypatch):
    graph, sample = small
    plan = build_plan(graph, builtin(graph, "spatial", 3), 3)
    monkeypatch.setattr(
        task_profile, "_time_piece", lambda graph, task, piece, *rest: float(piece.rect.volume)
    )
    per_rank = task_profile.profile_ranks(graph, plan, 1, sample)
    assert sorted(per_rank) == [0, 1, 2]
    assert len({tuple(sorted(seconds.items())) for seconds in per_rank.values()}) > 1
    busiest = task_profile.profile_as_run(graph, plan, 1, sample)
    for name, seconds in busiest.items():
        assert seconds == max((r.get(name, 0.0) for r in per_rank.values()), default=0.0)
