"""The measured machine file (`bench machine`'s keys): parsing, bad input, the link between
hosts and within one, and compute read from the table of measured pieces."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from partitioner.cost import compute_per_rank, plan_cost
from partitioner.machine import Machine
from partitioner.machine_file import machine_from_json, piece_key_of
from partitioner.piece_times import piece_key
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.mpi_transport import fit_link
from runtime.step import model as step_model
from runtime.step import prediction
from runtime.step.model import StepModel
from runtime.step.prediction import predict_step

PIECE = {"op": "linear", "phase": "forward", "attrs": {}, "shape": [1], "requirements": []}
BASE = {"rank_gflops": 10, "link_gbytes_per_s": 0.125, "latency_us": 30, "rank_memory_gib": 4}


def _graph_and_plan(strategy: str = "model", ranks: int = 2):
    graph = load_network("seed-lcn-small").lower(batch=8, optimizer="sgd")
    return graph, build_plan(graph, builtin(graph, strategy, ranks), ranks)


def _rows(graph, plan, seconds_of) -> list[dict]:
    """A pieces table for `plan`, piece k of the plan's distinct pieces taking `seconds_of(k)`."""
    rows: dict[str, dict] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        for piece in task_plan.pieces:
            key = piece_key(task, piece.rect.shape, piece.requirements)
            if key not in rows:
                op, phase, attrs, shape, requirements = json.loads(key)
                rows[key] = {
                    "op": op, "phase": phase, "attrs": attrs, "shape": shape,
                    "requirements": requirements, "threads": 1,
                    "seconds": seconds_of(len(rows)),
                }  # fmt: skip
    return list(rows.values())


def test_the_measured_keys_round_trip_and_place_ranks_on_hosts():
    graph, plan = _graph_and_plan()
    data = {
        **BASE,
        "ranks_per_host": 2,
        "intra_host": {"latency_us": 2, "gbytes_per_s": 8},
        "pieces": _rows(graph, plan, lambda k: 1e-4 * (k + 1)),
        "compute_factor": 1.25,
        "loop_us": 300,
        "message_overhead_us": 120.0,
        "link_burst_bytes": 32768.0,
        "hosts": 2,
        "rank_cores": 1,
        "duplex_gbytes_per_s": 0.12,
        "computing_gbytes_per_s": 0.04,
        "computing_send_gbytes_per_s": 0.05,
        "buffer_gbytes_per_s": {"copy": 12.0, "add": 11.0, "zero": 17.0},
        "pingpong": [{"pair": "inter_host", "bytes": 8, "seconds": 3e-5}],
        "measured_on": {"network": "seed-lcn-small", "batch": 8},
    }
    machine = machine_from_json(data)
    assert machine.to_json() == data
    assert machine_from_json(json.loads(json.dumps(machine.to_json()))) == machine
    assert machine.loop_seconds == pytest.approx(3e-4)
    assert machine.message_overhead == pytest.approx(1.2e-4)
    assert machine.computing_bytes_per_s == pytest.approx(4e7)
    assert machine.computing_send_bytes_per_s == pytest.approx(5e7)
    assert machine_from_json(BASE).computing_bytes_per_s == 0.0  # not held back
    assert machine.buffer_seconds_per_byte("add") == pytest.approx(1 / 11e9)
    # a pass not measured is priced as the memory traffic it makes, or not at all
    assert machine_from_json(BASE).buffer_seconds_per_byte("copy") == 0.0
    streaming = machine_from_json({**BASE, "memory_gbytes_per_s": 10.0})
    assert streaming.buffer_seconds_per_byte("copy") == pytest.approx(2 / 10e9)
    assert streaming.buffer_seconds_per_byte("add") == pytest.approx(3 / 10e9)
    assert streaming.buffer_seconds_per_byte("zero") == pytest.approx(1 / 10e9)
    assert [machine.host(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert machine.link(0, 1) == pytest.approx((2e-6, 1 / 8e9))
    assert machine.link(1, 2) == pytest.approx((30e-6, 1 / 0.125e9))
    # without ranks_per_host every rank is its own host: the link is between ranks
    assert machine_from_json(BASE).link(0, 1) == machine_from_json(BASE).link(0, 0)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"ranks_per_host": 0}, "ranks_per_host must be a positive integer"),
        ({"ranks_per_host": 1.5}, "ranks_per_host must be a positive integer"),
        ({"intra_host": {"latency_us": 2}}, "intra_host must be"),
        ({"intra_host": {"latency_us": 2, "gbytes_per_s": 0}}, "gbytes_per_s must be a positive"),
        ({"compute_factor": -1}, "compute_factor must be a number >= 0"),
        ({"loop_us": "fast"}, "loop_us must be a number >= 0"),
        ({"message_overhead_us": -5}, "message_overhead_us must be a number >= 0"),
        ({"link_burst_bytes": "big"}, "link_burst_bytes must be a number >= 0"),
        ({"duplex_gbytes_per_s": 0}, "duplex_gbytes_per_s must be a positive number"),
        ({"computing_gbytes_per_s": -1}, "computing_gbytes_per_s must be a positive number"),
        ({"computing_send_gbytes_per_s": "x"}, "computing_send_gbytes_per_s must be a positive"),
        ({"buffer_gbytes_per_s": {"move": 3}}, "buffer_gbytes_per_s must map some of copy"),
        ({"buffer_gbytes_per_s": 12}, "buffer_gbytes_per_s must map some of copy"),
        ({"buffer_gbytes_per_s": {"copy": 0}}, "buffer_gbytes_per_s: copy must be a positive"),
        ({"pieces": {"a": 1}}, "pieces must be a list"),
        ({"pieces": [{"op": "linear"}]}, r"pieces\[0\] needs op, phase"),
        ({"pieces": [PIECE | {"requirements": [1], "seconds": 1}]}, r"pieces\[0\] is malformed"),
        ({"pieces": [PIECE | {"seconds": -1}]}, r"pieces\[0\].seconds must be >= 0"),
        ({"link_gbps": 1}, "unknown key 'link_gbps'"),
        ({"pingpong": {"inter_host": 1}}, "pingpong must be a list"),
        ({"pingpong": [{"pair": "inter_host", "bytes": 8}]}, r"pingpong\[0\] must be"),
        ({"pingpong": [{"pair": "wan", "bytes": 8, "seconds": 1e-5}]}, r"pingpong\[0\].pair"),
        (
            {"pingpong": [{"pair": "inter_host", "bytes": 0.5, "seconds": 1e-5}]},
            r"pingpong\[0\].bytes must be a positive integer",
        ),
        (
            {"pingpong": [{"pair": "inter_host", "bytes": 8, "seconds": 0}]},
            r"pingpong\[0\].seconds must be a positive number",
        ),
    ],
)
def test_a_bad_measured_key_is_one_line_naming_it(extra, message, tmp_path, capsys):
    with pytest.raises(LegionNNError, match=message):
        machine_from_json({**BASE, **extra})
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({**BASE, **extra}))
    assert main(["partition", "seed-lcn-small", "--ranks", "2", "--machine", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err


def test_compute_is_read_from_the_pieces_table_with_factor_and_overhead():
    graph, plan = _graph_and_plan()
    rows = _rows(graph, plan, lambda k: 1e-4 * (k + 1))
    machine = machine_from_json(
        {**BASE, "task_overhead_us": 20, "compute_factor": 1.5, "pieces": rows}
    )
    seconds = {piece_key_row: row["seconds"] for piece_key_row, row in zip(machine.pieces, rows)}
    per_task = compute_per_rank(graph, plan, machine)
    for task, task_plan, got in zip(graph.tasks, plan.tasks, per_task):
        expected = np.zeros(plan.nranks)
        working = np.zeros(plan.nranks, bool)
        for piece in task_plan.pieces:
            for rank in piece.ranks:
                expected[rank] += seconds[piece_key(task, piece.rect.shape, piece.requirements)]
                working[rank] = True
        expected = np.where(working, expected * 1.5 + 20e-6, 0.0)
        np.testing.assert_allclose(got, expected, rtol=1e-12, err_msg=task.name)
    # plan_cost's busiest rank reads the same table
    cost = plan_cost(graph, plan, machine)
    for task_cost, per in zip(cost.tasks, per_task):
        if per.any():
            assert task_cost.compute_s == pytest.approx(float(per.max()), rel=1e-9)


def test_a_task_with_a_piece_the_table_lacks_is_priced_by_the_flop_model():
    graph, plan = _graph_and_plan()
    rows = _rows(graph, plan, lambda k: 1.0)  # a second a piece: far from the FLOP model
    lacking = next(i for i, t in enumerate(graph.tasks) if t.op == "linear")
    task = graph.tasks[lacking]
    gone = {piece_key(task, p.rect.shape, p.requirements) for p in plan.tasks[lacking].pieces}
    kept = [r for r in rows if _key(r) not in gone]
    measured = compute_per_rank(graph, plan, machine_from_json({**BASE, "pieces": kept}))
    modelled = compute_per_rank(graph, plan, machine_from_json(BASE))
    for index, (task, task_plan) in enumerate(zip(graph.tasks, plan.tasks)):
        keys = {piece_key(task, p.rect.shape, p.requirements) for p in task_plan.pieces}
        if keys & gone:
            np.testing.assert_allclose(measured[index], modelled[index], rtol=1e-12)
        elif keys:
            assert measured[index].max() >= 1.0, task.name
    assert gone and len(kept) < len(rows)


def _key(row: dict) -> str:
    return piece_key_of(row["op"], row["phase"], row["attrs"], row["shape"], row["requirements"])


def test_a_link_fit_recovers_latency_and_bandwidth():
    sizes = [8, 1024, 65536, 1 << 20, 4 << 20, 16 << 20]
    latency, per_byte = 25e-6, 1 / 0.117e9
    latency_fit, per_byte_fit = fit_link([(s, latency + s * per_byte) for s in sizes])
    # the latency is the smallest message's time: 8 bytes' worth above the true intercept
    assert latency_fit == pytest.approx(latency + 8 * per_byte, rel=1e-12)
    assert per_byte_fit == pytest.approx(per_byte, rel=1e-9)


def test_the_step_is_simulated_where_its_programs_are_few_enough_to_build(monkeypatch):
    graph, plan = _graph_and_plan()
    machine = Machine(**{**BASE, "loop_us": 500})
    cost = plan_cost(graph, plan, machine)
    step = StepModel(machine).step_prediction(graph, plan, cost.step_seconds)
    assert step["step_model"] == "simulated"
    assert step["predicted_step_seconds"] == pytest.approx(
        predict_step(graph, plan, machine).seconds + 5e-4, rel=1e-12
    )
    assert step["bulk_synchronous_seconds"] == pytest.approx(cost.step_seconds + 5e-4)
    # room to build 3 ranks' programs of 8: up to `PLACED_MAX_RANKS` ranks, whose memory is
    # placed from every rank's program anyway, no limit applies; beyond (here made 4), a
    # data-parallel step builds 2 (rank 0, which holds the loss, and one for the 7 alike) and is
    # simulated, and the ranks of a model-parallel step all differ, and it is summed
    room = 3 * len(graph.tasks)
    monkeypatch.setattr(step_model, "SIMULATE_MAX_WORK", room)
    model = build_plan(graph, builtin(graph, "model", 8), 8)
    step = StepModel(machine).step_prediction(graph, model, 1.0)
    assert step["step_model"] == "simulated"
    assert step["predicted_step_seconds"] == pytest.approx(
        predict_step(graph, model, machine).seconds + 5e-4, rel=1e-12
    )
    monkeypatch.setattr(step_model, "PLACED_MAX_RANKS", 4)
    data = build_plan(graph, builtin(graph, "data", 8), 8)
    step = StepModel(machine).step_prediction(graph, data, 1.0)
    assert step["step_model"] == "simulated"
    assert step["predicted_step_seconds"] == pytest.approx(
        predict_step(graph, data, machine).seconds + 5e-4, rel=1e-12
    )
    # past the classes it builds, every rank's own program is built, in shares
    # (`simulated_in_shares`), and the step is the same; past `SIMULATE_EVERY_RANK_MAX_WORK`
    # (here made 8 ranks' less one pair), it is summed
    assert StepModel(machine).programs(graph, model, room) is None
    step = StepModel(machine).step_prediction(graph, model, 1.0)
    assert step["step_model"] == "simulated"
    assert step["predicted_step_seconds"] == pytest.approx(
        predict_step(graph, model, machine).seconds + 5e-4, rel=1e-12
    )
    monkeypatch.setattr(prediction, "SIMULATE_EVERY_RANK_MAX_WORK", 8 * len(graph.tasks) - 1)
    step = StepModel(machine).step_prediction(graph, model, 1.0)
    assert step["step_model"] == "bulk-synchronous"
    assert step["predicted_step_seconds"] == step["bulk_synchronous_seconds"] == 1.0005


def test_partition_json_gives_the_simulated_step(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["partition", "seed-lcn-small", "--ranks", "2", "--strategy", "model", "--json"]
    assert main([*argv, str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["step_model"] == "simulated"
    assert report["predicted_step_seconds"] > 0 and report["bulk_synchronous_seconds"] > 0
    # where the command's time went, printed (the JSON stays the same from run to run)
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(
        r"planned in \d+\.\d\d s; its step and memory predicted in \d+\.\d\d s", last
    )
    assert not {"planning_seconds", "prediction_seconds"} & set(report)


def test_partition_simulates_a_step_past_the_budget_when_asked(tmp_path, monkeypatch, capsys):
    """Past the work a simulation builds (here made one pair, on more ranks than are always
    placed, here made 4), a model-parallel step on 8 ranks is summed, and the table says so;
    with `--simulate` it is simulated all the same: the step reported on 8 ranks by default."""
    argv = ["partition", "seed-lcn-small", "--ranks", "8", "--strategy", "model", "--json"]
    assert main([*argv, str(tmp_path / "default.json")]) == 0
    default = json.loads((tmp_path / "default.json").read_text())
    assert default["step_model"] == "simulated"
    monkeypatch.setattr(step_model, "PLACED_MAX_RANKS", 4)
    monkeypatch.setattr(step_model, "SIMULATE_MAX_WORK", 1)
    monkeypatch.setattr(prediction, "SIMULATE_EVERY_RANK_MAX_WORK", 1)
    capsys.readouterr()
    assert main([*argv, str(tmp_path / "summed.json")]) == 0
    summed = json.loads((tmp_path / "summed.json").read_text())
    assert summed["step_model"] == "bulk-synchronous"
    assert summed["predicted_step_seconds"] == summed["bulk_synchronous_seconds"]
    assert "bulk-synchronous sum: its ranks' programs are past" in capsys.readouterr().out
    assert main([*argv, str(tmp_path / "asked.json"), "--simulate"]) == 0
    asked = json.loads((tmp_path / "asked.json").read_text())
    assert asked["step_model"] == "simulated"
    assert asked["predicted_step_seconds"] == default["predicted_step_seconds"]
    assert asked["predicted_step_seconds"] != summed["predicted_step_seconds"]


#: an unshaped veth's ping-pong between hosts, measured (`bench machine` on `cluster --link
#: unlimited`): messages that stay in the cores' caches cross at twice the large ones' rate
VETH = [(8, 7.1e-6), (1024, 1.28e-5), (65536, 3.62e-5), (1 << 20, 8.58e-4),
        (4 << 20, 3.35e-3), (16 << 20, 2.294e-2), (64 << 20, 0.1227)]  # fmt: skip


def test_a_links_burst_is_read_off_its_ping_pongs():
    from runtime.mpi_transport import fit_burst

    latency, per_byte = 50e-6, 8e-9  # 1 Gbit/s
    sizes = [8, 1024, 65536, 1 << 20, 4 << 20, 16 << 20]
    for burst in (32 * 1024, 256 * 1024):
        points = [(n, latency + max(n - burst, 0) * per_byte) for n in sizes]
        fitted = fit_link(points)
        assert fit_burst(points, *fitted) == pytest.approx(burst, rel=0.02)
    plain = [(n, latency + n * per_byte) for n in sizes]
    assert fit_burst(plain, *fit_link(plain)) == 0.0
    # a rate that changes with the size is no bucket: an unshaped veth's ping-pong, measured
    assert fit_burst(VETH, *fit_link(VETH)) == 0.0
    # and tbf's, 1 Gbit/s with its default burst, is one
    tbf = [(8, 7.4e-6), (1024, 1.37e-5), (65536, 2.4e-5), (1 << 20, 6.714e-3),
           (4 << 20, 3.3055e-2), (16 << 20, 0.13832), (64 << 20, 0.55937)]  # fmt: skip
    assert 200_000 < fit_burst(tbf, *fit_link(tbf)) < 300_000


def test_a_link_prices_each_message_at_the_measured_time_of_its_size():
    from runtime.step.links import Links

    latency, per_byte = fit_link(VETH)
    intra = [(8, 1e-6), (65536, 2e-5), (1 << 20, 1.5e-4)]
    data = {
        **BASE,
        "latency_us": latency * 1e6,
        "link_gbytes_per_s": 1 / per_byte / 1e9,
        "ranks_per_host": 2,
        "intra_host": {"latency_us": 1.0, "gbytes_per_s": 8.0},
        "pingpong": [{"pair": "inter_host", "bytes": n, "seconds": t} for n, t in VETH]
        + [{"pair": "intra_host", "bytes": n, "seconds": t} for n, t in intra],
    }
    machine = machine_from_json(data)
    assert machine.to_json() == data
    for within, points, alpha in ((False, VETH, latency), (True, intra, 1e-6)):
        sizes = np.array([n for n, _ in points])
        seconds = alpha + sizes * machine.link_per_byte(sizes, within)
        assert seconds == pytest.approx([t for _, t in points], rel=1e-12)
        # between two points, between their times; beyond the last, the fitted rate
        middle = (sizes[1:] + sizes[:-1]) // 2
        between = alpha + middle * machine.link_per_byte(middle, within)
        assert np.all(between > [t for _, t in points[:-1]])
        assert np.all(between < [t for _, t in points[1:]])
    beyond = np.array([128 << 20])
    fitted_rate = machine.link_per_byte(beyond, False)
    assert latency + (128 << 20) * fitted_rate[0] == pytest.approx(0.1227 + (64 << 20) * per_byte)
    # mid-size messages cross at the rate they were measured at, not the large ones'
    assert machine.link_per_byte(np.array([1 << 20]), False)[0] < 0.5 * per_byte
    # the step simulators read the same rates, and the stack's at the link's for the size
    stacked = replace(machine, duplex_gbytes_per_s=0.3)
    links = Links.of(stacked, 4)
    nbytes = np.array([1 << 20, 1 << 20, 64 << 20])
    beta, stack = links.rates(nbytes, np.array([True, False, True]))
    assert list(beta) == [*machine.link_per_byte(nbytes[:1], False),
                          *machine.link_per_byte(nbytes[1:2], True),
                          *machine.link_per_byte(nbytes[2:], False)]  # fmt: skip
    assert stack[1] == 0.0
    assert stack[0] / beta[0] == pytest.approx(stacked.stack_beta / stacked.beta)
    # a link with a burst is its token bucket and rate; a link not measured, its rate
    for plain in (replace(machine, link_burst_bytes=65536.0), machine_from_json(BASE)):
        rates = plain.link_per_byte(np.array([8, 1 << 20, 64 << 20]), False)
        assert list(rates) == [plain.beta] * 3


def test_the_stack_prices_each_exchange_at_the_measured_time_of_its_size():
    """Exchanges timed by size (`pingpong`'s `duplex` pair): the stack takes half an
    exchange's seconds a byte at each measured size, so a simulated exchange takes the measured
    time; between sizes the points are joined, beyond the largest the fitted duplex rate; never
    slower than the link one way. Without those points, the fitted rate at the link's rate for
    the size; on a full-duplex link, nothing."""
    latency, per_byte = fit_link(VETH)
    duplex = [(1 << 20, 2.5e-3), (16 << 20, 0.037), (64 << 20, 0.2), (256 << 20, 0.98)]
    data = {
        **BASE,
        "latency_us": latency * 1e6,
        "link_gbytes_per_s": 1 / per_byte / 1e9,
        "duplex_gbytes_per_s": 0.27,
        "pingpong": [{"pair": "inter_host", "bytes": n, "seconds": t} for n, t in VETH]
        + [{"pair": "duplex", "bytes": n, "seconds": t} for n, t in duplex],
    }
    machine = machine_from_json(data)
    assert machine.to_json() == data
    sizes = np.array([n for n, _ in duplex], np.float64)
    stack = machine.stack_per_byte(sizes)
    link = machine.link_per_byte(sizes, False)
    measured = np.array([t for _, t in duplex])
    assert np.all(stack <= link)
    below = stack < link  # where the exchange is slower than two one-way messages' halves
    assert list(below) == [False, True, True, True]  # 1 MiB: capped at the link
    assert (machine.alpha + 2 * sizes * stack)[below] == pytest.approx(measured[below], rel=1e-12)
    middle = np.array([32 << 20], np.float64)
    assert 0.037 < machine.alpha + 2 * middle[0] * machine.stack_per_byte(middle)[0] < 0.2
    far = np.array([512 << 20], np.float64)
    assert machine.alpha + 2 * far[0] * machine.stack_per_byte(far)[0] == pytest.approx(
        0.98 + (256 << 20) / 0.27e9
    )
    unmeasured = replace(machine, link_curves={"inter_host": machine.link_curves["inter_host"]})
    assert unmeasured.stack_per_byte(sizes) == pytest.approx(
        unmeasured.stack_beta * link / unmeasured.beta
    )
    full = replace(machine, duplex_gbytes_per_s=1 / per_byte / 1e9)
    assert list(full.stack_per_byte(sizes)) == [0.0] * 4
    bad = {**data, "pingpong": [{"pair": "both", "bytes": 8, "seconds": 1e-5}]}
    with pytest.raises(LegionNNError, match="pair must be one of inter_host, intra_host, duplex"):
        machine_from_json(bad)


def test_ranks_beyond_their_hosts_cores_time_share_them():
    """Two ranks a host on one core: each rank's kernels, and the runtime's Python around them
    (per task and per step), take twice their time alone (they were timed with the rank alone);
    with a core each, as alone."""
    graph, plan = _graph_and_plan("data", 4)
    rows = _rows(graph, plan, lambda k: 1e-3)
    costs = {**BASE, "pieces": rows, "ranks_per_host": 2, "task_overhead_us": 40, "loop_us": 500}
    alone = machine_from_json({**costs, "host_cores": 2})
    shared = machine_from_json({**costs, "host_cores": 1})
    assert list(alone.core_share(4)) == [1.0] * 4 and list(shared.core_share(4)) == [0.5] * 4
    for a, b in zip(compute_per_rank(graph, plan, alone), compute_per_rank(graph, plan, shared)):
        assert a.max() > 1e-3 + 39e-6  # the piece and the overhead
        np.testing.assert_allclose(b, 2 * a, rtol=1e-12)
    assert alone.step_loop_seconds(4) == pytest.approx(500e-6)
    assert shared.step_loop_seconds(4) == pytest.approx(1000e-6)
    assert shared.step_loop_seconds(3) == pytest.approx(1000e-6)  # the slowest rank's
    # a rank alone on its host (3 ranks in blocks of 2: the third) has its core to itself
    assert list(shared.core_share(3)) == [0.5, 0.5, 1.0]
    assert list(shared.core_share(1)) == [1.0]
    with pytest.raises(LegionNNError, match="host_cores must be a positive integer"):
        machine_from_json({**BASE, "host_cores": 0})


def test_the_stacks_cpu_a_byte_is_at_most_its_time_a_byte_both_ways():
    """On a link whose stack takes the whole core, both directions at once run at the duplex
    rate d each: a byte of an exchange then costs the core 1 / 2d, whatever a one-way stream
    beside a kernel measured. On a full-duplex link, or below that bound, the measure stands."""
    veth = Machine(link_gbytes_per_s=0.5, duplex_gbytes_per_s=0.35, network_cpu_ns_per_byte=1.9)
    assert veth.stack_beta == pytest.approx(1 / 0.7e9)
    assert veth.network_cpu_seconds_per_byte == pytest.approx(1 / 0.7e9)
    cheap = Machine(link_gbytes_per_s=0.5, duplex_gbytes_per_s=0.35, network_cpu_ns_per_byte=1.0)
    assert cheap.network_cpu_seconds_per_byte == pytest.approx(1.0e-9)
    nic = Machine(link_gbytes_per_s=0.125, duplex_gbytes_per_s=0.125, network_cpu_ns_per_byte=1.9)
    assert nic.stack_beta == 0.0
    assert nic.network_cpu_seconds_per_byte == pytest.approx(1.9e-9)
