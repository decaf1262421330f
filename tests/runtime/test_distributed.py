"""`legion-nn train` under real `mpiexec -n K` jobs, launched from pytest with timeouts.

Each job trains seed-lcn-small in float64 on synthetic data and is compared with the same command
on one process: the same losses (1e-9 relative) and the same final parameters (from the
checkpoint), with `bytes_sent == bytes_planned` on every rank and step. Faults must end the job
within 30 seconds, with one line naming the rank and the task.

Every job runs under each launcher: `mpiexec` on this host, and `legion-nn cluster run` on an
emulated cluster of 2 and of 3 hosts (namespaces joined by 1 Gbit/s links, MPI over TCP between
them; root only), where the faults strike a rank on a host other than the first. After a
cluster job nothing of it may be left: no namespace, no cluster state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.paths import FIXTURES, ROOT

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not installed")

CLUSTER_MISSING = (
    "the emulated cluster needs root"
    if os.geteuid() != 0
    else "the emulated cluster needs iproute2 (ip, tc) and util-linux (nsenter, unshare)"
    if any(shutil.which(tool) is None for tool in ("ip", "tc", "nsenter", "unshare"))
    else None
)
#: where a job's ranks run: this host, or an emulated cluster of that many hosts
LAUNCHERS = [
    "local",
    *(
        pytest.param(hosts, marks=pytest.mark.skipif(CLUSTER_MISSING is not None,
                                                     reason=CLUSTER_MISSING or ""))
        for hosts in ("2 hosts", "3 hosts")
    ),
]  # fmt: skip

TRAIN = [
    "--data",
    "synthetic",
    "--dtype",
    "float64",
    "--batch",
    "7",
    "--seed",
    "2",
    "--no-progress",
]
JOB_TIMEOUT = 240


def legion_nn(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    root = str(ROOT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


#: the clusters of this module's jobs are named for it, so that a check for leftovers sees
#: them and not another user's
CLUSTER = f"m{os.getpid() % 10_000_000}"


def job(launcher: str, nranks: int, *args: str) -> list[str]:
    """`legion-nn ARGS` as one job of `nranks` ranks under `launcher`."""
    if launcher == "local":
        return ["mpiexec", "-n", str(nranks), *legion_nn(*args)]
    hosts = launcher.split()[0]
    return [
        *legion_nn("cluster", "run", "--name", CLUSTER, "--hosts", hosts, "--link", "1gbit",
                   "-n", str(nranks), "--"),
        *legion_nn(*args),
    ]  # fmt: skip


def first_rank_off_the_first_host(launcher: str, nranks: int) -> int:
    """Ranks are placed in blocks, host by host: 3 ranks on 2 hosts are 2, then 1."""
    if launcher == "local":
        return 1
    hosts = int(launcher.split()[0])
    return -(-nranks // hosts)


def cluster_namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "-json", "netns", "list"], capture_output=True, text=True, check=False
    )
    names = {entry["name"] for entry in json.loads(out.stdout or "[]")}
    return {name for name in names if name.startswith(f"lnn-{CLUSTER}-")}


def mpich_segments() -> set[Path]:
    return set(Path("/dev/shm").glob("mpich_*"))


def mapped_anywhere() -> set[Path]:
    """The MPICH segments some live process maps (other users' jobs keep theirs while they run)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process has gone meanwhile
            continue
        mapped |= {Path(line.split()[-1]) for line in lines if "/dev/shm/mpich_" in line}
    return mapped


@pytest.fixture(params=LAUNCHERS)
def launcher(request):
    """Each launcher in turn; after a job, nothing of it is left: MPICH's shared-memory segment
    (unlinked once every rank has mapped it, so after MPI_Abort and SIGKILL too), and after a
    cluster job its namespaces and state."""
    before = mpich_segments()
    yield request.param
    left = mpich_segments() - before - mapped_anywhere()
    assert not left, f"a job left MPICH's shared memory behind: {sorted(left)}"
    if request.param != "local":
        assert not cluster_namespaces(), "a cluster job left namespaces behind"
        assert not Path(f"/run/legion-nn/clusters/{CLUSTER}").exists()


def skip_unless_spread(launcher: str, nranks: int) -> None:
    """Each job runs on this host and on one emulated cluster: 2 hosts for 2 ranks, 3 hosts for
    3 ranks or more (where a fourth rank shares a host, so a host's ranks talk over shared
    memory and across the link at once). A job of fewer ranks than the cluster's hosts would
    run as it does on fewer hosts, and one of 3 ranks or more on 2 hosts as on 3: skip them."""
    if launcher == "local":
        return
    hosts = int(launcher.split()[0])
    if nranks < hosts:
        pytest.skip("fewer ranks than hosts")
    if hosts == 2 and nranks >= 3:
        pytest.skip("3 ranks or more run on 3 hosts")


def mpiexec(
    nranks: int, *args: str, env=None, timeout=JOB_TIMEOUT, launcher: str = "local"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        job(launcher, nranks, *args),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env or environment(),
    )


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(path: Path) -> list[float]:
    return [r["loss"] for r in records(path) if "step" in r and r.get("rank") == 0]


def parameters(directory: Path) -> dict[str, np.ndarray]:
    with np.load(directory / "checkpoint.npz") as archive:
        return {name: archive[name] for name in archive.files if name != "header"}


def assert_equals_single(single, log: Path, checkpoint: Path) -> None:
    """The run's losses and checkpointed parameters are the one process's (`single`)."""
    expected_losses, expected_params = single
    np.testing.assert_allclose(losses(log), expected_losses, rtol=1e-9)
    got = parameters(checkpoint)
    for name, value in expected_params.items():
        scale = max(np.abs(value).max(), 1e-30)
        assert np.abs(got[name] - value).max() / scale < 1e-9, name


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = subprocess.run(
        legion_nn(
            "train", *TRAIN, "--steps", "4", "--log-json", str(out / "log.jsonl"),
            "--checkpoint", str(out / "ckpt"),
        ),
        capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return losses(out / "log.jsonl"), parameters(out / "ckpt")


@pytest.mark.parametrize(
    "nranks,strategy,homes",
    [
        (1, "data", "replicated"),
        (2, "model", "replicated"),
        (3, "spatial", "replicated"),
        (4, "auto", "replicated"),
        (3, "data", "replicated"),
        # halving-doubling all-reduces, one rank folded in and out (`collectives`)
        (5, "data", "replicated"),
        # reduce-scatters by the ring and by halving, two ranks folded in (`collectives`)
        (6, "data", "sharded"),
        (2, "spatial", "sharded"),
        # the classifier's input all-gathered by halving, one rank folded in and out
        # (`partitioner.gathers`)
        (5, "model", "replicated"),
    ],
)
def test_mpiexec_equals_one_process(single, tmp_path, launcher, nranks, strategy, homes):
    """Every strategy, and parameters sharded (gathered before each use, their gradients
    reduce-scattered): the checkpoint holds whole tensors either way."""
    skip_unless_spread(launcher, nranks)
    if launcher == "3 hosts" and (strategy, homes) in (
        ("spatial", "replicated"),
        ("data", "replicated"),
        ("data", "sharded"),
    ):
        pytest.skip("on 2 hosts already; 3 hosts keep auto (4 ranks, a host with two)")
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        nranks, "train", *TRAIN, "--steps", "4", "--strategy", strategy,
        "--param-homes", homes, "--log-json", str(log), "--checkpoint", str(tmp_path / "ckpt"),
        "--trace", str(tmp_path / "trace.json"), launcher=launcher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_equals_single(single, log, tmp_path / "ckpt")
    steps = [r for r in records(log) if "step" in r]
    assert sorted({r["rank"] for r in steps}) == list(range(nranks))
    assert len(steps) == 4 * nranks
    for record in steps:
        assert record["bytes_sent"] == record["bytes_planned"], record
        assert 0 < record["compute_seconds"] < record["seconds"], record  # kernels, then waits
    if nranks > 1:
        assert any(r["bytes_sent"] > 0 for r in steps)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(nranks))


#: AdamW, clipping below every step's norm, and a warm-up cosine schedule (issue 32)
OPTIMIZER_OPTIONS = [
    "--weight-decay", "0.1", "--clip-grad-norm", "0.05", "--lr-schedule", "cosine",
    "--warmup-steps", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def single_clipped(tmp_path_factory):
    out = tmp_path_factory.mktemp("clipped")
    result = subprocess.run(
        legion_nn(
            "train", *TRAIN, *OPTIMIZER_OPTIONS, "--steps", "4", "--log-json",
            str(out / "log.jsonl"), "--checkpoint", str(out / "ckpt"),
        ),
        capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return losses(out / "log.jsonl"), parameters(out / "ckpt"), records(out / "log.jsonl")


@pytest.mark.parametrize("strategy", ["model", "spatial"])
def test_optimizer_options_split_equal_one_process(single_clipped, tmp_path, launcher, strategy):
    """Weight decay, the learning rate's schedule and clipping by the norm over every rank's
    gradients: 2 ranks equal one process, and log the same norms and learning rates."""
    skip_unless_spread(launcher, 2)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        2, "train", *TRAIN, *OPTIMIZER_OPTIONS, "--steps", "4", "--strategy", strategy,
        "--log-json", str(log), "--checkpoint", str(tmp_path / "ckpt"), launcher=launcher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_equals_single(single_clipped[:2], log, tmp_path / "ckpt")
    expected = [r for r in single_clipped[2] if "step" in r]
    for rank in (0, 1):
        got = [r for r in records(log) if "step" in r and r["rank"] == rank]
        assert [r["lr"] for r in got] == [r["lr"] for r in expected]
        np.testing.assert_allclose(
            [r["grad_norm"] for r in got], [r["grad_norm"] for r in expected], rtol=1e-9
        )
    assert min(r["grad_norm"] for r in expected) > 0.05  # every step clipped


def test_a_directory_of_npy_files_split_by_rows_equals_one_process(single, tmp_path, launcher):
    """`--data DIR`: the synthetic set written as .npy files, read in place, each rank reading
    its rows of pixels and their halo: the one process's run on the set in memory."""
    from legion_nn.networks import load_network
    from runtime import data

    skip_unless_spread(launcher, 2)
    network = load_network("seed-lcn-small")
    dataset = data.load("synthetic", network.input, network.classes, 2, np.float64)
    directory = tmp_path / "npy"
    directory.mkdir()
    for part in ("train", "val", "test"):
        np.save(directory / f"x_{part}.npy", getattr(dataset, part).x)
        np.save(directory / f"y_{part}.npy", getattr(dataset, part).y)
    log = tmp_path / "log.jsonl"
    args = [a if a != "synthetic" else str(directory) for a in TRAIN]
    result = mpiexec(
        2, "train", *args, "--steps", "4", "--strategy", "spatial", "--log-json", str(log),
        "--checkpoint", str(tmp_path / "ckpt"), launcher=launcher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_equals_single(single, log, tmp_path / "ckpt")


GPT = str(FIXTURES / "tiny_gpt.onnx")


@pytest.fixture(scope="module")
def single_gpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_gpt")
    result = subprocess.run(
        legion_nn(
            "train", GPT, *TRAIN, "--steps", "2", "--log-json", str(out / "log.jsonl"),
            "--checkpoint", str(out / "ckpt"),
        ),
        capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return losses(out / "log.jsonl"), parameters(out / "ckpt")


@pytest.mark.parametrize(("strategy", "nranks"), [("model", 2), ("auto", 4)])
def test_a_gpt_split_by_heads_equals_one_process(single_gpt, tmp_path, launcher, strategy, nranks):
    """The PyTorch export of a GPT (`tiny_gpt.onnx`), its attention split by heads and its
    dense layers by columns over 2 ranks, or as auto plans it on 4: the one process's losses
    and parameters."""
    skip_unless_spread(launcher, nranks)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        nranks, "train", GPT, *TRAIN, "--steps", "2", "--strategy", strategy, "--log-json",
        str(log), "--checkpoint", str(tmp_path / "ckpt"), launcher=launcher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_equals_single(single_gpt, log, tmp_path / "ckpt")
    steps = [r for r in records(log) if "step" in r]
    assert all(r["bytes_sent"] == r["bytes_planned"] > 0 for r in steps)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "1f1b-deferred"])
def test_a_pipeline_equals_one_process(single, tmp_path, launcher, schedule):
    """Two stages, a rank each, streaming 4 micro-batches: the activations cross the cut as
    copies, their gradients come back as partial sums, and the run is the one process's."""
    skip_unless_spread(launcher, 2)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        2, "train", *TRAIN, "--steps", "4", "--stages", "2", "--micro-batches", "4",
        "--schedule", schedule, "--log-json", str(log), "--checkpoint", str(tmp_path / "ckpt"),
        launcher=launcher,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"in 2 stages, 4 micro-batches ({schedule})" in result.stdout
    assert_equals_single(single, log, tmp_path / "ckpt")
    steps = [r for r in records(log) if "step" in r]
    assert all(r["bytes_sent"] == r["bytes_planned"] > 0 for r in steps)


def test_adding_hops_in_many_segments_equal_one_process(single, tmp_path, launcher):
    """Collective hops received 40 bytes at a time (`running_collective.Adding`), over shared
    memory and TCP: every segment is added where it belongs and the run is the one process's."""
    skip_unless_spread(launcher, 3)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        3, "train", *TRAIN, "--steps", "4", "--strategy", "data", "--log-json", str(log),
        "--checkpoint", str(tmp_path / "ckpt"), launcher=launcher,
        env=environment(LEGION_NN_HOP_SEGMENT_BYTES="40"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_equals_single(single, log, tmp_path / "ckpt")
    assert all(r["bytes_sent"] == r["bytes_planned"] for r in records(log) if "step" in r)


MLP = str(FIXTURES / "mlp_small.json")


def one_process_losses(out: Path, network: str, steps: int) -> list[float]:
    """The losses of `steps` steps of `network` trained in one process."""
    result = subprocess.run(
        legion_nn("train", network, *TRAIN, "--steps", str(steps), "--log-json", str(out / "log.jsonl")),
        capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return losses(out / "log.jsonl")


@pytest.fixture(scope="module")
def mlp_single(tmp_path_factory):
    return one_process_losses(tmp_path_factory.mktemp("mlp"), MLP, 4)


@pytest.mark.parametrize("nranks", [2, 4])
def test_a_row_parallel_plan_equals_one_process(mlp_single, tmp_path, launcher, nranks):
    """Megatron's MLP block, column then row (fc1 split over its outputs, fc2 over its inputs:
    partial sums reduce-scattered over the batch), from a strategy file naming fc2's summed
    dims."""
    skip_unless_spread(launcher, nranks)
    grids = tmp_path / "grids.json"
    grids.write_text(
        json.dumps(
            {
                "grids": {
                    "fc1": [1, nranks, 1, 1],
                    "act": [1, nranks, 1, 1],
                    "fc2.linear2": [1, 1, 1, 1, nranks, 1, 1],
                    "fc2.softmax": [nranks, 1, 1, 1],
                    "fc2.evaluate.accuracy": [1],
                }
            }
        )
    )
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        nranks, "train", MLP, *TRAIN, "--steps", "4", "--strategy", str(grids),
        "--log-json", str(log), launcher=launcher,
    )  # fmt: skip
    assert_equals_one_process(result, log, mlp_single, nranks, 4)


NARROWING = str(FIXTURES / "narrowing.json")


@pytest.fixture(scope="module")
def narrowing_single(tmp_path_factory):
    return one_process_losses(tmp_path_factory.mktemp("narrowing"), NARROWING, 4)


def test_collectives_with_extra_participants_equal_one_process(
    narrowing_single, tmp_path, launcher
):
    """12 outputs read by a classifier of 5 on 8 ranks: its input all-gathered among its 5
    ranks, the 3 other holders handing their parts on first, and its input gradient one
    reduce-scatter among the 5 whose partners hand those 3 their sums
    (`Reduction.core_places`)."""
    skip_unless_spread(launcher, 8)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        8, "train", NARROWING, *TRAIN, "--steps", "4", "--strategy", "model",
        "--log-json", str(log), launcher=launcher,
    )  # fmt: skip
    assert_equals_one_process(result, log, narrowing_single, 8, 4)


def assert_equals_one_process(result, log: Path, expected: list[float], nranks: int, steps: int):
    """The job's losses are one process's, and every rank of every step sent what it planned."""
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(losses(log), expected, rtol=1e-9)
    found = [r for r in records(log) if "step" in r]
    assert len(found) == steps * nranks
    for record in found:
        assert record["bytes_sent"] == record["bytes_planned"] > 0, record


RESIDUAL = str(FIXTURES / "residual_small.json")


@pytest.fixture(scope="module")
def residual_single(tmp_path_factory):
    return one_process_losses(tmp_path_factory.mktemp("residual"), RESIDUAL, 3)


@pytest.mark.parametrize("nranks,strategy", [(2, "spatial"), (3, "model")])
def test_a_residual_network_with_a_concat_equals_one_process(
    residual_single, tmp_path, launcher, nranks, strategy
):
    """A residual add, a side branch and a concat (`tests/runtime/test_executor.py`'s RESIDUAL as a
    spec file), split over rows or channels, under mpiexec."""
    skip_unless_spread(launcher, nranks)
    log = tmp_path / "log.jsonl"
    result = mpiexec(
        nranks, "train", RESIDUAL, *TRAIN, "--steps", "3", "--strategy", strategy,
        "--log-json", str(log), launcher=launcher,
    )  # fmt: skip
    assert_equals_one_process(result, log, residual_single, nranks, 3)


def assert_ends_naming(result: subprocess.CompletedProcess, started: float, pattern: str) -> None:
    """The job failed within 30 s, a line of ours matches `pattern`, and a rank's death is named
    only where one was killed (a signal, not an error or a stall)."""
    assert result.returncode != 0
    assert time.monotonic() - started < 30 + 15  # 30 s to end, plus start-up
    lines = [line for line in result.stderr.splitlines() if line.startswith("legion-nn")]
    assert any(re.search(pattern, line) for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    if "died" not in pattern:
        assert not any(re.search(r"rank \d+ died", line) for line in lines), result.stderr


def test_an_exception_in_a_kernel_ends_the_job(tmp_path, launcher):
    skip_unless_spread(launcher, 3)
    victim = first_rank_off_the_first_host(launcher, 3)
    started = time.monotonic()
    result = mpiexec(
        3, "train", *TRAIN, "--steps", "50", launcher=launcher,
        env=environment(LEGION_NN_FAULT=f"raise:{victim}:L1.filter.grad"),
    )  # fmt: skip
    assert_ends_naming(
        result, started, rf"rank {victim}: step 0, task L1\.filter\.grad: InjectedFault"
    )


def test_a_killed_rank_ends_the_job_and_is_named(tmp_path, launcher):
    skip_unless_spread(launcher, 3)
    rank = first_rank_off_the_first_host(launcher, 3)
    log = tmp_path / "log.jsonl"
    command = job(launcher, 3, "train", *TRAIN, "--steps", "100000", "--log-json", str(log))
    running = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment()
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if log.exists() and any('"step": 2' in line for line in log.read_text().splitlines()):
                break
        starts = [r for r in records(log) if r.get("event") == "start"]
        victim = next(r["pid"] for r in starts if r["rank"] == rank)
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, stderr = running.communicate(timeout=60)
    finally:
        if running.poll() is None:
            running.kill()
    result = subprocess.CompletedProcess(command, running.returncode, "", stderr)
    assert_ends_naming(
        result, started, rf"rank {rank} died in step \d+, task \S+: killed by SIGKILL"
    )
    named = [line for line in stderr.splitlines() if re.search(r"rank \d+ died", line)]
    assert len(named) == 1, stderr


def restartable_job(launcher: str, nranks: int, restarts: int, *args: str) -> list[str]:
    """`job`, started again from its newest checkpoint when it fails, `restarts` times at most:
    by `legion-nn launch`, or by `legion-nn cluster run` on the emulated cluster."""
    if launcher == "local":
        words = ["launch", "-n", str(nranks), "--max-restarts", str(restarts), "--"]
        return [*legion_nn(*words), *legion_nn(*args)]
    command = job(launcher, nranks, *args)
    cut = command.index("--")
    return [*command[:cut], "--max-restarts", str(restarts), *command[cut:]]


@pytest.fixture(scope="module")
def long_single(tmp_path_factory):
    return one_process_losses(tmp_path_factory.mktemp("long"), "seed-lcn-small", 150)


def test_a_job_that_loses_a_rank_restarts_from_its_newest_checkpoint(
    tmp_path, launcher, long_single
):
    """Rank 1 SIGKILLed mid-run: its death is named, the job is started again from the newest
    checkpoint (said in one line), ends with exit 0, and its last 10 losses are an
    uninterrupted run's."""
    skip_unless_spread(launcher, 2)
    log, saved = tmp_path / "log.jsonl", tmp_path / "ckpt"
    command = restartable_job(
        launcher, 2, 2, "train", *TRAIN, "--steps", "150", "--checkpoint", str(saved),
        "--checkpoint-every", "20", "--log-json", str(log),
    )  # fmt: skip
    running = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment()
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while time.monotonic() < deadline and not (saved / "checkpoint.npz").exists():
            time.sleep(0.02)
        starts = [r for r in records(log) if r.get("event") == "start"]
        os.kill(next(r["pid"] for r in starts if r["rank"] == 1), signal.SIGKILL)
        _, stderr = running.communicate(timeout=JOB_TIMEOUT)
    finally:
        if running.poll() is None:
            running.kill()
    assert running.returncode == 0, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("legion-nn")]
    assert len([line for line in lines if re.search(r"rank 1 died in step \d+", line)]) == 1
    restarts = [line for line in lines if "restart" in line]
    assert len(restarts) == 1 and re.search(
        r"restart 1 of 2 from \S+checkpoint-\d{8}\.npz", restarts[0]
    )
    resumed = [r["step"] for r in records(log) if r.get("event") == "resume"]
    assert len(resumed) == 1 and 0 < resumed[0] < 150
    np.testing.assert_allclose(losses(log)[-10:], long_single[-10:], rtol=1e-9)


def test_the_stall_watchdog_names_the_ranks_waited_for(launcher):
    skip_unless_spread(launcher, 3)  # a rank a host on 3 hosts
    nranks = 2 if launcher == "local" else int(launcher.split()[0])
    victim = first_rank_off_the_first_host(launcher, nranks)
    started = time.monotonic()
    result = mpiexec(
        nranks, "train", *TRAIN, "--steps", "5", "--stall-timeout", "3", launcher=launcher,
        env=environment(LEGION_NN_FAULT=f"hang:{victim}:L1.filter"),
    )  # fmt: skip
    assert_ends_naming(
        result, started, rf"rank 0: step 0, task \S+ .*has waited \d+ s for rank {victim}"
    )


#: the run a checkpoint written on 3 ranks resumes
TWO_EPOCHS = [*TRAIN, "--batch", "40", "--epochs", "2"]


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """One process's losses over `TWO_EPOCHS`, once for every launcher."""
    whole = tmp_path_factory.mktemp("two-epochs") / "whole.jsonl"
    result = subprocess.run(
        legion_nn("train", *TWO_EPOCHS, "--log-json", str(whole)),
        capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT, env=environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return losses(whole)


def test_checkpoint_on_3_ranks_resumes_on_another_count(tmp_path, launcher, two_epochs):
    skip_unless_spread(launcher, 3)
    args = TWO_EPOCHS
    ckpt = str(tmp_path / "ckpt")
    first = mpiexec(3, "train", *TRAIN, "--batch", "40", "--epochs", "1", "--checkpoint", ckpt,
                    "--strategy", "spatial", launcher=launcher)  # fmt: skip
    assert first.returncode == 0, first.stderr
    resumed_log = tmp_path / "resumed.jsonl"
    again = {"local": 2, "2 hosts": 2, "3 hosts": 4}[launcher]  # another count, >= the hosts
    second = mpiexec(again, "train", *args, "--checkpoint", ckpt, "--resume", "--strategy",
                     "model", "--log-json", str(resumed_log), launcher=launcher)  # fmt: skip
    assert second.returncode == 0, second.stderr
    expected = two_epochs
    resumed = losses(resumed_log)
    assert 0 < len(resumed) < len(expected)
    np.testing.assert_allclose(resumed, expected[-len(resumed) :], rtol=1e-9)


def test_bad_strategy_is_one_line_from_rank_0():
    result = mpiexec(2, "train", *TRAIN, "--steps", "1", "--strategy", "diagonal")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("legion-nn")]
    assert len(lines) == 1 and "unknown strategy 'diagonal'" in lines[0], result.stderr
