"""`legion-nn trace summary`: per-rank time and the critical path of synthetic trace-v1 files."""

import json

import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from visualize.trace_file import load_trace, parse_trace
from visualize.trace_summary import critical_path, format_summary, rank_times, summary


def trace(*events, ranks=None, **meta):
    """A trace-v1 file's object with metadata events, as the MPI runtime writes it."""
    pids = sorted({e["pid"] for e in events})
    ranks = ranks if ranks is not None else max(pids) + 1
    metadata = [
        {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}}
        for r in range(ranks)
    ] + [
        {"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": n}}
        for r in range(ranks)
        for t, n in ((0, "compute"), (1, "communication"))
    ]
    other = {"format": "legion-nn/trace-v1", "ranks": ranks, "network": "tiny", "strategy": "data"}
    other.update(meta)
    return {"traceEvents": metadata + list(events), "displayTimeUnit": "ms", "otherData": other}


def compute(rank, name, ts, dur, step=0):
    args = {"step": step, "task": name, "phase": "forward"}
    return {"ph": "X", "pid": rank, "tid": 0, "ts": ts, "dur": dur, "name": name,
            "cat": "compute", "args": args}  # fmt: skip


def message(kind, rank, peer, ts, dur, msg_id, task="B", step=0):
    args = {"step": step, "task": task, "tensor": "x", "rect": {"lo": [0], "hi": [4]},
            "bytes": 16, "peer": peer, "id": msg_id}  # fmt: skip
    return {"ph": "X", "pid": rank, "tid": 1, "ts": ts, "dur": dur, "name": f"{kind} x",
            "cat": kind, "args": args}  # fmt: skip


def collective(rank, ts, dur, task="L0.filter.grad", step=0, participants=(0, 1, 2)):
    args = {"step": step, "task": task, "tensor": "L0.W.grad", "bytes": 1024,
            "algorithm": "allreduce", "participants": list(participants)}  # fmt: skip
    return {"ph": "X", "pid": rank, "tid": 1, "ts": ts, "dur": dur, "name": "allreduce L0.W.grad",
            "cat": "collective", "args": args}  # fmt: skip


def path_of(data):
    return [
        (s.rank, s.name, s.cat, s.start, s.end) for s in critical_path(parse_trace(data)).segments
    ]


# Rank 0 computes A, posts its output to rank 1 at 100 (the send completes at 150) and computes
# D; rank 1 computes B, waits for A's output from 40 to 130, then computes C until 200.
TWO_RANKS = trace(
    compute(0, "A", 0, 100),
    message("send", 0, 1, 100, 50, "m1", task="C"),
    compute(0, "D", 100, 60),
    compute(1, "B", 0, 40),
    message("recv", 1, 0, 40, 90, "m1", task="C"),
    compute(1, "C", 130, 70),
)


def test_busy_communicating_and_idle_per_rank():
    times = {t.rank: t for t in rank_times(parse_trace(TWO_RANKS))}
    assert (times[0].span, times[0].busy, times[0].communicating, times[0].idle) == (160, 160, 0, 0)
    assert (times[1].span, times[1].busy, times[1].communicating, times[1].idle) == (
        200,
        110,
        90,
        0,
    )
    assert times[1].communicating_by_cat == {"recv": 90}


def test_send_time_counts_only_where_the_rank_does_nothing_else():
    data = trace(
        compute(0, "A", 0, 10),
        message("send", 0, 1, 10, 50, "m", task="X"),  # overlaps B, then drains alone
        compute(0, "B", 10, 20),
        message("recv", 0, 1, 35, 10, "n", task="C"),  # a wait inside the draining send
        compute(0, "C", 45, 5),
        compute(1, "X", 0, 100),
    )
    (rank0, _) = rank_times(parse_trace(data))
    assert rank0.span == 60
    assert rank0.busy == 35  # A, B, C
    assert rank0.communicating == 25  # 30..45 and 50..60: the send alone, and the wait
    assert rank0.communicating_by_cat == {"recv": 10, "send": 15}
    assert rank0.idle == 0


def test_idle_is_the_rest_of_the_rank_span():
    data = trace(compute(0, "A", 0, 10), compute(0, "B", 30, 10), compute(1, "C", 0, 100))
    rank0 = rank_times(parse_trace(data))[0]
    assert (rank0.span, rank0.busy, rank0.communicating, rank0.idle) == (40, 20, 0, 20)


def test_a_recv_jumps_to_the_sender_that_produced_the_message():
    assert path_of(TWO_RANKS) == [
        (0, "A", "compute", 0, 100),
        (1, "C", "message", 100, 130),
        (1, "C", "compute", 130, 200),
    ]
    path = critical_path(parse_trace(TWO_RANKS))
    assert path.length == 200 == path.span_end - path.span_start
    assert path.by_category() == {"compute": 170, "message": 30}


def test_a_send_posted_mid_task_jumps_to_the_running_task():
    data = trace(
        compute(0, "A", 0, 100),
        message("send", 0, 1, 60, 10, "m", task="C"),
        compute(1, "C", 80, 50),
        message("recv", 1, 0, 20, 60, "m", task="C"),
    )
    assert path_of(data) == [
        (0, "A", "compute", 0, 60),
        (1, "C", "message", 60, 80),
        (1, "C", "compute", 80, 130),
    ]


def test_a_collective_jumps_to_the_participant_that_arrived_last():
    data = trace(
        compute(0, "G0", 0, 50),
        collective(0, 50, 70),
        compute(1, "G1", 0, 100),
        collective(1, 100, 20),
        compute(2, "G2", 0, 30),
        collective(2, 30, 90),
        compute(0, "E", 120, 30),
    )
    assert path_of(data) == [
        (1, "G1", "compute", 0, 100),
        (0, "L0.filter.grad", "collective", 100, 120),
        (0, "E", "compute", 120, 150),
    ]
    times = {t.rank: t for t in rank_times(parse_trace(data))}
    assert (times[2].busy, times[2].communicating, times[2].idle) == (30, 90, 0)


def test_gaps_on_the_path_are_idle_and_checkpoints_count_as_busy():
    data = trace(
        compute(0, "A", 0, 10),
        {**compute(0, "save", 20, 5), "cat": "checkpoint"},
        compute(0, "B", 40, 10),
    )
    assert path_of(data) == [
        (0, "A", "compute", 0, 10),
        (0, "", "idle", 10, 20),
        (0, "save", "checkpoint", 20, 25),
        (0, "", "idle", 25, 40),
        (0, "B", "compute", 40, 50),
    ]
    rank0 = rank_times(parse_trace(data))[0]
    assert rank0.busy == 25 and rank0.busy_by_cat == {"checkpoint": 5, "compute": 20}


def test_a_truncated_trace_stays_on_the_rank():
    # rank 0 died before its send was written; rank 2 never reached the collective
    data = trace(
        compute(1, "B", 0, 40),
        message("recv", 1, 0, 40, 60, "lost", task="C"),
        compute(1, "C", 100, 10),
        collective(1, 110, 5),
        ranks=3,
    )
    assert path_of(data) == [
        (1, "B", "compute", 0, 40),
        (1, "C", "recv", 40, 100),
        (1, "C", "compute", 100, 110),
        (1, "L0.filter.grad", "collective", 110, 115),
    ]
    times = rank_times(parse_trace(data))
    assert [t.span for t in times] == [0, 115, 0]


def test_steps_and_the_path_per_step():
    events = []
    for step in range(3):
        base = 1000 * step
        events += [compute(0, "F", base, 400, step), compute(1, "F", base, 300, step)]
        events += [compute(0, "G", base + 400, 200, step), compute(1, "G", base + 300, 100, step)]
    report = summary(parse_trace(trace(*events)))
    assert report["steps"] == 3
    assert report["span_seconds"] == pytest.approx(2600e-6)
    per_step = report["critical_path"]["per_step"]
    assert [s["span_seconds"] for s in per_step] == pytest.approx([600e-6] * 3)
    assert [s["path_seconds"] for s in per_step] == pytest.approx([600e-6, 1000e-6, 1000e-6])
    assert report["critical_path"]["by_category"] == pytest.approx(
        {"compute": 1800e-6, "idle": 800e-6}
    )


def test_cli_prints_the_table_and_the_path_and_writes_json(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TWO_RANKS))
    out = tmp_path / "s.json"
    assert main(["trace", "summary", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "network tiny, strategy data, 2 ranks, 1 step," in lines[0]
    (rank1,) = [line for line in lines if line.startswith("   1 ")]
    assert rank1.split() == ["1", "0.000200", "0.000110", "55.0", "0.000090", "45.0", "0.000000",
                             "0.0"]  # fmt: skip
    assert "critical path: 0.000200 s of the 0.000200 s span (100.0%)" in text
    assert "compute 0.000170 s (85.0%), message 0.000030 s (15.0%)" in text
    report = json.loads(out.read_text())
    assert report["ranks"][1]["communicating_seconds"] == pytest.approx(90e-6)
    assert [s["name"] for s in report["critical_path"]["segments"]] == ["A", "C", "C"]


def test_long_paths_are_elided_in_the_middle(tmp_path, capsys):
    events = [compute(0, f"T{i}", 10 * i, 10) for i in range(100)]
    path = tmp_path / "long.json"
    path.write_text(json.dumps(trace(*events)))
    assert main(["trace", "summary", str(path), "--path-rows", "20"]) == 0
    text = capsys.readouterr().out
    assert "... 80 more ..." in text and " T0 " in text and " T99 " in text and " T50 " not in text


def write(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"traceEvents": [', "bad.json:1: not JSON"),
        ([{"ph": "X"}], "not a Chrome trace object with a traceEvents list"),
        ({"traceEvents": []}, "otherData.format is None, not 'legion-nn/trace-v1'"),
        (
            {"traceEvents": [], "otherData": {"format": "other/v2"}},
            "otherData.format is 'other/v2'",
        ),
        (trace(compute(0, "A", 0, 1)) | {"traceEvents": []}, "no complete (ph X) events"),
        (
            trace({**compute(0, "A", 0, 1), "ts": "soon"}),
            "traceEvents[3]: 'ts' must be a number, got 'soon'",
        ),
        (trace({**compute(0, "A", 0, 1), "dur": -4}), "traceEvents[3]: negative dur"),
        (trace({**compute(0, "A", 0, 1), "pid": -1}, ranks=1), "'pid' must be a rank or thread"),
        (trace({**compute(0, "A", 0, 1), "tid": 0.5}), "'tid' must be a rank or thread"),
        (
            json.dumps(trace({**compute(0, "A", 0, 1), "ts": float("nan")})),
            "traceEvents[3]: 'ts' must be a number, got nan",
        ),
    ],
    ids=[
        "not-json",
        "array",
        "no-format",
        "wrong-format",
        "no-events",
        "bad-ts",
        "negative-dur",
        "negative-pid",
        "fractional-tid",
        "nan",
    ],
)
def test_bad_traces_fail_with_one_line(tmp_path, capsys, content, message):
    path = write(tmp_path, content)
    out = tmp_path / "s.json"
    assert main(["trace", "summary", str(path), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    with pytest.raises(LegionNNError):
        load_trace(path)


def test_missing_file_and_missing_subcommand_fail_with_one_line(tmp_path, capsys):
    assert main(["trace", "summary", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "none.json" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["trace"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_trace_written_by_the_runtime_summarises(tmp_path):
    """The reader against the writer: two ranks in threads, spatial, so halos cross ranks."""
    import numpy as np

    from legion_nn.networks import load_network
    from runtime import data
    from runtime.distributed import RunOptions, train_rank
    from runtime.training import TrainConfig
    from runtime.transport import run_threads

    network = load_network("seed-lcn-small")
    dataset = data.synthetic(network.input, network.classes, seed=3, samples=60, dtype=np.float64)
    cfg = TrainConfig(network=network, dataset=dataset, batch=7, dtype="float64", seed=5, steps=2)
    path = tmp_path / "trace.json"
    options = RunOptions(strategy="spatial", stall_timeout=60, trace=str(path))
    run_threads(2, lambda transport: train_rank(cfg, transport, options))
    trace_data = load_trace(path)
    report = summary(trace_data)
    assert report["network"] == "seed-lcn-small" and len(report["ranks"]) == 2
    for row in report["ranks"]:
        parts = row["busy_seconds"] + row["communicating_seconds"] + row["idle_seconds"]
        assert parts == pytest.approx(row["span_seconds"])
        assert row["busy_seconds"] > 0
    path_report = report["critical_path"]
    assert path_report["seconds"] == pytest.approx(
        sum(path_report["by_category"].values()), rel=1e-9
    )
    assert path_report["seconds"] <= report["span_seconds"] * (1 + 1e-9)
    ranks_on_path = {s["rank"] for s in path_report["segments"]}
    assert ranks_on_path <= {0, 1}
    # every recv of the file pairs with a send, so no wait on the path is left unexplained
    sends = {e.args["id"] for e in trace_data.events if e.cat == "send"}
    assert all(e.args["id"] in sends for e in trace_data.events if e.cat == "recv")
    assert "recv" not in path_report["by_category"]


def test_a_ranks_waiting_is_its_median_share_of_a_step_not_computing():
    """Two stages: rank 0 computes 0-60 and 100-140 of step 0 (span 0-200 over both ranks),
    rank 1 60-200; in step 1 (200-300) each computes half. Rank 0 waits (200 - 100) / 200 and
    50/100 (median 0.5), rank 1 60/200 and 50/100 (median 0.4); evaluation steps do not count."""
    data = parse_trace(
        trace(
            compute(0, "F", 0, 60),
            compute(0, "B", 100, 40),
            compute(1, "F", 60, 140),
            compute(0, "F", 200, 50, step=1),
            compute(1, "F", 250, 50, step=1),
            compute(0, "F", 300, 10, step="eval"),
        )
    )
    report = summary(data)
    assert report["waiting_per_step"] == pytest.approx({"0": 0.5, "1": 0.4})
    assert "rank 0 50%, rank 1 40%; mean 45%" in format_summary(report, "t.json")
