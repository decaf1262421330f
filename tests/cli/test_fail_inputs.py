"""Every input in tests/fail/ must fail with one clear line, exit status 2, and no output file."""

import json
import subprocess
import sys

import pytest

from tests.paths import FAIL

EXPECTED = {
    "unparseable.json": "unparseable.json:4: not valid JSON",
    "unparseable.toml": "not valid TOML",
    "unknown_kind.json": "unknown layer kind 'convolution3d'",
    "window_too_large.json": "window 9x9 is larger than its padded input 5x5",
    "zero_channels.json": "out_channels must be a positive int, got 0",
    "negative_input.json": "input must be images [C, H, W] or token ids [T] of positive ints",
    "negative_stride.json": "stride must be a positive int, got -1",
    "zero_classes.json": "classes must be a positive int, got 0",
    "class_mismatch.json": "softmax gets 7 scores but the network has 10 classes",
    "unknown_option.json": "filter layer has no option 'kernal'",
    "softmax_needs_scores.json": "or [T, classes], got [10, 16, 16]",
    "evaluate_without_softmax.json": "needs a softmax layer before it",
    "bad_reshape.json": "cannot reshape [1, 20, 20] (400 values) to [3, 10, 10] (300 values)",
    "not_an_object.json": "not_an_object.json:1: a network spec must be a JSON object",
    "missing_layers.json": "the spec has no 'layers'",
    "duplicate_group.json": "group L0 already has a filter layer",
}


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_every_fail_input_has_an_expectation():
    on_disk = {p.name for p in FAIL.iterdir() if p.suffix in (".json", ".toml")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_spec_fails_cleanly(name, tmp_path):
    out = tmp_path / "graph.json"
    result = run_cli("graph", str(FAIL / name), "--json", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert EXPECTED[name] in lines[0]
    assert name in lines[0], "the message names the file"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["graph", "seed-lcn-small", "--batch", "0"], "--batch must be at least 1, got 0"),
        (["graph", "seed-lcn-small", "--batch", "-3"], "--batch must be at least 1, got -3"),
        (["graph", "no-such-network"], "unknown network 'no-such-network'"),
        (["graph", "missing.json"], "missing.json: cannot read"),
        (["graph", "seed-lcn-small", "--batch", "x"], "invalid int value: 'x'"),
        (
            ["graph", "seed-lcn-small", "--batch", "8", "--micro-batches", "9"],
            "--micro-batches 9 is larger than the batch of 8 samples",
        ),
        (["graph", "seed-lcn-small", "--micro-batches", "0"], "--micro-batches must be at least 1"),
        (["graph", "seed-lcn-small", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
        (
            ["graph", "seed-lcn-small", "--micro-batches", "2", "--schedule", "gpipe"],
            "--schedule orders the micro-batches of a pipeline's stages",
        ),
    ],
)
def test_bad_arguments_fail_cleanly(args, fragment, tmp_path):
    result = run_cli(*args, "--json", str(tmp_path / "g.json"), cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize(
    "command", [["train", "--steps", "1"], ["graph"], ["partition", "--ranks", "2"]]
)
@pytest.mark.parametrize("name", ["blob.bin", "blob.json"])
def test_a_binary_file_given_as_the_network_fails_cleanly(command, name, tmp_path):
    """Bytes that are not UTF-8 (an ONNX protobuf or any blob under another name) are named in
    one line, where the file is read."""
    blob = tmp_path / name
    blob.write_bytes(bytes([0x08, 0x07, 0x12, 0x93, 0xFF, 0x00, 0x41]) * 40)
    result = run_cli(command[0], str(blob), *command[1:])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"legion-nn {command[0]}: {blob}: ")
    assert "not UTF-8 text" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0 and "graph" in result.stdout


def test_outputs_get_the_usual_file_mode(tmp_path):
    import os
    import stat

    from legion_nn.atomic import write_text

    path = tmp_path / "out.json"
    write_text(path, "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


MACHINE = {"rank_gflops": 100, "link_gbytes_per_s": 12.5, "latency_us": 2, "rank_memory_gib": 16}
PARTITION_FILES = {
    "machine.json": {
        "not JSON": ("{rank_gflops: 1", "machine.json: not JSON"),
        "not an object": ("[1, 2]", "machine.json: a machine must be a JSON object"),
        "missing": (json.dumps({"rank_gflops": 1}), "machine.json: missing link_gbytes_per_s"),
        "unknown": (json.dumps({**MACHINE, "cores": 4}), "machine.json: unknown key 'cores'"),
        "negative": (
            json.dumps({**MACHINE, "latency_us": -2}),
            "machine.json: latency_us must be a positive number, got -2",
        ),
        "op rate": (
            json.dumps({**MACHINE, "op_gflops": {"filter": "fast"}}),
            "op_gflops: filter must be a positive number, got 'fast'",
        ),
    },
    "grids.json": {
        "not R pieces": (
            json.dumps({"grids": {"L0": [1, 1, 2, 1]}}),
            "grids.json: grid [1, 1, 2, 1] for L0 makes 2 pieces, not 4 (one per rank)",
        ),
        "no grids": (json.dumps({"L0": [4, 1, 1, 1]}), 'grids.json: a strategy file is {"grids"'),
        "too many parts": (
            json.dumps({"grids": {"L0": [1, 1, 1, 17]}}),
            "grids.json: grid [1, 1, 1, 17] for L0: dim 3 of extent 16 cannot be cut into 17",
        ),
    },
    "bench.json": {
        "not a report": (json.dumps({"sgemm_gflops": 1}), "--calibrate bench.json: not a"),
    },
}
FLAGS = {"machine.json": "--machine", "grids.json": "--strategy", "bench.json": "--calibrate"}


@pytest.mark.parametrize(
    "name, case", [(name, case) for name, cases in PARTITION_FILES.items() for case in cases]
)
def test_bad_partition_files_fail_cleanly(name, case, tmp_path):
    text, fragment = PARTITION_FILES[name][case]
    (tmp_path / name).write_text(text)
    args = ["partition", "seed-lcn-small", "--ranks", "4", "--strategy", "data"]
    if name == "grids.json":
        args = args[:-1] + [name]
    else:
        args += [FLAGS[name], name]
    result = run_cli(*args, "--json", "out.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert fragment in result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--ranks", "0", "--strategy", "data"], "--ranks must be at least 1, got 0"),
        (["--ranks", "-4", "--strategy", "model"], "--ranks must be at least 1, got -4"),
        (["--ranks", "4", "--strategy", "diagonal"], "--strategy: unknown strategy 'diagonal'"),
        (["--ranks", "4", "--time-limit", "-1"], "--time-limit must be at least 0"),
        (["--sweep", "4,0", "--strategy", "data"], "--sweep needs positive rank counts"),
        (["--ranks", "4", "--strategy", "missing.json"], "missing.json: No such file"),
        (["--strategy", "data"], "give --ranks R"),
        (["--ranks", "2", "--batch", "4", "--micro-batches", "5"], "--micro-batches 5 is larger"),
    ],
)
def test_bad_partition_arguments_fail_cleanly(args, fragment, tmp_path):
    result = run_cli("partition", "seed-lcn-small", *args, "--json", "out.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr
    assert not (tmp_path / "out.json").exists()
