"""A rank's own passes over memory around its tasks (`runtime.step.local_passes`), worked by hand
on a sharded plan the runtime runs: its windows filled, its scratch zeroed, its kept half added,
its partial sums packed and added, and its parameters' halves moved with no staging copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from legion_nn.sources import load_source_graph
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, with_homes
from runtime.instances import choose_storage_orders
from runtime.step.local_passes import PassPrices, task_passes
from runtime.step.prediction import predict_step, simulate_compiled
from runtime.step.programs import build_programs
from runtime.step.simulator import simulate_step

MLP = Path(__file__).resolve().parents[2] / "fixtures" / "mlp_small.json"
COPY, ADD, ZERO = 2.0, 4.0, 8.0  # GB/s of data
MACHINE = Machine(
    memory_gbytes_per_s=10.0,
    message_overhead_us=5.0,
    buffer_gbytes_per_s={"copy": COPY, "add": ADD, "zero": ZERO},
)


def _sharded_mlp(batch: int = 4):
    graph = load_source_graph(str(MLP), batch, batch)
    plan = build_plan(graph, with_homes(graph, builtin(graph, "data", 2), "sharded"), 2)
    return graph, plan, build_programs(graph, plan, MACHINE, range(2))


def _position(program, name: str) -> int:
    (found,) = [i for i, rt in enumerate(program.tasks) if rt.task.name == name]
    return found


def test_a_sharded_weights_gradient_task_pays_the_runtimes_passes_around_it():
    """Rank 0 of a data plan with sharded homes on 2 ranks computes fc2's weight gradient (its
    weights 8 x 32 float32: 1024 bytes, a half of 512 at each home): the other half of the weights
    arrives straight in its window (no copy), its own half is copied in; the gradient's scratch is
    the whole weight, zeroed; after the kernel it packs and posts the other home's half, adds its
    own half into its home, and adds the half the other rank sent."""
    graph, _, programs = _sharded_mlp()
    passes = task_passes(
        programs[0], 0, PassPrices.of(MACHINE), graph, choose_storage_orders(graph)
    )
    at = _position(programs[0], "fc2.linear2.grad")
    whole, half, post = 1024, 512, 5e-6
    assert passes.before_copies[at] == pytest.approx(post)  # the partial sum's receive posted
    assert passes.after_copies[at] == pytest.approx(half / (COPY * 1e9) + whole / (ZERO * 1e9))
    assert passes.after_compute[at] == pytest.approx(half / (COPY * 1e9) + post)
    assert passes.after_partial_out[at] == pytest.approx(half / (ADD * 1e9))
    assert passes.after_partial_in[at] == pytest.approx(half / (ADD * 1e9))
    # the forward reads the whole weight too: its own half copied into the window, no scratch
    forward = _position(programs[0], "fc2.linear2")
    assert passes.after_copies[forward] == pytest.approx(half / (COPY * 1e9))
    # posting the halves before it (a send from the home, a receive into the window): no copies
    before = _position(programs[0], "act.filterNL")
    assert passes.after_compute[before] == pytest.approx(2 * post)


def test_programs_alone_stage_every_copy_and_price_nothing_else():
    """Without the graph (a program made by hand), every copy is packed and unpacked and no
    window, scratch or kept part is priced."""
    _, _, programs = _sharded_mlp()
    alone = task_passes(programs[0], 0, PassPrices.of(MACHINE))
    at = _position(programs[0], "fc2.linear2.grad")
    assert alone.after_copies[at] == pytest.approx(512 / (COPY * 1e9))  # the half unpacked
    assert alone.after_partial_out[at] == 0.0
    before = _position(programs[0], "act.filterNL")
    assert alone.after_compute[before] == pytest.approx(512 / (COPY * 1e9) + 2 * 5e-6)


def test_both_simulators_price_the_passes_alike_and_they_lengthen_the_step():
    """The passes are read by both simulators, to the last bit, and a step whose buffers move
    at half the speed takes longer."""
    graph, plan, programs = _sharded_mlp(64)
    exact = predict_step(graph, plan, MACHINE, programs=programs, simulate=simulate_step)
    fast = predict_step(graph, plan, MACHINE, programs=programs, simulate=simulate_compiled)
    assert (fast.seconds, fast.finish, fast.waiting) == (exact.seconds, exact.finish, exact.waiting)
    slower = Machine(
        memory_gbytes_per_s=10.0,
        message_overhead_us=5.0,
        buffer_gbytes_per_s={"copy": COPY / 2, "add": ADD / 2, "zero": ZERO / 2},
    )
    slow = predict_step(graph, plan, slower, programs=programs, simulate=simulate_step)
    assert slow.seconds > exact.seconds
