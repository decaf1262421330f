"""`legion-nn cluster`: hosts as namespaces, links limited by tbf, one mpiexec job across them.

The parsing and placement tests run anywhere; the rest build real clusters and need root and
iproute2 (they skip with that reason). Each real test checks that nothing of its clusters is left:
no namespace, no state directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cache_eviction import cheapest_cold
from cli.main import main
from legion_nn.errors import LegionNNError
from runtime import cluster, cluster_links
from tests.paths import ROOT

MISSING = (
    "needs root"
    if os.geteuid() != 0
    else "needs iproute2 and util-linux"
    if any(shutil.which(t) is None for t in ("ip", "tc", "nsenter", "unshare", "mpiexec"))
    else None
)
needs_root = pytest.mark.skipif(MISSING is not None, reason=f"the emulated cluster {MISSING}")


def legion_nn(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        legion_nn(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(),
        check=False,
    )


@pytest.mark.parametrize(
    "text,bits",
    [("1gbit", 1e9), ("500mbit", 5e8), ("6.5Gbit", 6.5e9), ("100kbps", 8e5), ("unlimited", None)],
)
def test_rates_parse_as_tc_writes_them(text, bits):
    assert cluster_links.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gb", "0gbit", "-1mbit", ""])
def test_a_bad_rate_is_one_line_naming_the_flag(text):
    with pytest.raises(LegionNNError, match="--link: expected a rate"):
        cluster_links.parse_rate(text)


def test_ranks_are_placed_in_blocks_and_hosts_get_their_own_cores():
    two = cluster.Cluster("t", 2, 1e9, ((0,), (1,)))
    assert two.placement(3) == [2, 1]
    assert two.placement(1) == [1, 0]
    assert cluster.host_cores(2, [0, 1, 2, 3, 4]) == ((0, 1, 2), (3, 4))
    assert cluster.host_cores(3, [0, 1]) == ((0,), (1,), (0,))
    command = cluster.mpiexec_command(two, 3, ["legion-nn", "train"])
    assert command[command.index("-hosts") + 1] == "t-h0:2,t-h1:1"


def test_without_root_one_line_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["cluster", "run", "--hosts", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err


@pytest.mark.parametrize("name", ["Bad", "with-dash", "toolongname", "1st"])
def test_a_bad_cluster_name_is_refused(name):
    with pytest.raises(LegionNNError, match="cluster name"):
        cluster.check_name(name)


def namespaces() -> set[str]:
    return set(cluster.existing_namespaces())


_NAMES = iter(range(10**6))


@pytest.fixture
def clean():
    """A cluster name for the test; whatever the test does, no namespace and no state of that
    name is left behind."""
    name = f"t{os.getpid() % 100000}{next(_NAMES)}"[:8]
    yield name
    assert not [n for n in namespaces() if cluster.cluster_of(n) == name]
    assert not (cluster.STATE_ROOT / name).exists()


PROBE = """
import json, os, socket, sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
open(f"/dev/shm/lnn-probe-{rank}", "w").close()
MPI.COMM_WORLD.Barrier()
seen = sorted(f for f in os.listdir("/dev/shm") if f.startswith("lnn-probe"))
record = {"host": socket.gethostname(), "cores": sorted(os.sched_getaffinity(0)), "shm": seen}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(record, out)
"""


@needs_root
def test_a_job_spans_hosts_with_their_own_names_shm_and_cores(clean, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    result = run(
        "cluster", "run", "--name", clean, "--hosts", "2", "-n", "3", "--",
        sys.executable, str(probe), str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    hosts = [r["host"] for r in ranks]
    assert hosts[0] == hosts[1] != hosts[2]
    assert hosts[0].endswith("-h0") and hosts[2].endswith("-h1")
    # listed after every rank wrote: a host sees its own ranks' files only
    assert ranks[0]["shm"] == ranks[1]["shm"] == ["lnn-probe-0", "lnn-probe-1"]
    assert ranks[2]["shm"] == ["lnn-probe-2"]
    assert not list(Path("/dev/shm").glob("lnn-probe-*"))
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(ranks[0]["cores"]) & set(ranks[2]["cores"])


STREAM = """
import os, socket, sys, time
rank, size, peer = int(os.environ["PMI_RANK"]), 16 << 20, sys.argv[1]
if rank == 0:
    server = socket.create_server(("0.0.0.0", 45123))
    connection, _ = server.accept()
    got = 0
    while got < size:
        got += len(connection.recv(1 << 20))
    connection.sendall(b"k")
else:
    for _ in range(200):
        try:
            connection = socket.create_connection((peer, 45123))
            break
        except OSError:
            time.sleep(0.05)
    start = time.perf_counter()
    connection.sendall(bytes(size))
    connection.recv(1)
    print(size * 8 / (time.perf_counter() - start) / 1e9, flush=True)
"""


@needs_root
def test_the_link_is_limited_to_its_rate_between_hosts(clean, tmp_path):
    script = tmp_path / "stream.py"
    script.write_text(STREAM)
    name = clean
    assert run("cluster", "up", name, "--hosts", "2", "--link", "400mbit").returncode == 0
    try:
        result = run(
            "cluster", "run", "--on", name, "-n", "2", "--",
            sys.executable, str(script), f"{name}-h0",
        )  # fmt: skip
    finally:
        run("cluster", "down", name)
    assert result.returncode == 0, result.stderr
    gbits = float(result.stdout.split()[-1])
    # tbf lets no more through than its rate, but for one burst; a loaded machine may deliver less
    assert 0.1 < gbits < 0.4 * 1.1, gbits


def test_hosts_may_be_given_cores_each_and_then_share_them():
    assert cluster.host_cores(2, [0, 1], per_host=1) == ((0,), (1,))
    assert cluster.host_cores(2, [0, 1], per_host=2) == ((0, 1), (0, 1))
    assert cluster.host_cores(3, [4, 5, 6, 7], per_host=2) == ((4, 5), (6, 7), (4, 5))


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--shaping", "ingress"], "--shaping: expected egress or both"),
        (["--offload", "yes"], "--offload: expected on or off"),
        (["--burst", "lots"], "--burst: expected a size"),
        (["--burst", "8k"], "--burst 8k: below the 16KiB segments"),
        (["--offload", "on", "--burst", "32k"], "--burst 32k: below the 64KiB segments"),
        (["--link", "unlimited", "--burst", "256k"], "--burst shapes a limited link"),
        (["--link", "unlimited", "--shaping", "egress"], "--shaping shapes a limited link"),
        (["--cores-per-host", "0"], "--cores-per-host: expected 1 to"),
        (["--cores-per-host", "999"], "--cores-per-host: expected 1 to"),
    ],
)
def test_unknown_or_contradictory_cluster_options_are_one_line(argv, names, capsys):
    """Checked before anything is built (and before root is asked for)."""
    for command in (["cluster", "run", *argv, "--", "true"], ["cluster", "up", "x", *argv]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and names in err and err.startswith("legion-nn cluster:")


def test_run_on_a_cluster_refuses_the_options_that_build_one(monkeypatch, capsys):
    assert main(["cluster", "run", "--on", "lab", "--offload", "on", "--", "true"]) == 2
    assert "--offload builds a cluster" in capsys.readouterr().err


def test_the_burst_defaults_to_fifty_microseconds_of_the_rate_and_two_segments():
    plain, offload = cluster_links.LinkOptions(), cluster_links.LinkOptions(offload=True)
    assert plain.burst_for(1e9) == 32 * 1024 and offload.burst_for(1e9) == 128 * 1024
    assert plain.burst_for(40e9) == int(40e9 / 8 * 50e-6)
    assert cluster_links.LinkOptions(burst_bytes=300_000).burst_for(1e9) == 300_000
    assert cluster_links.parse_size("256k") == cluster_links.parse_size("256KiB") == 262144


def _qdiscs(namespace: str, device: str) -> str:
    return subprocess.run(
        ["tc", "-n", namespace, "qdisc", "show", "dev", device],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def _burst(qdiscs: str) -> int:
    """The tbf's burst in bytes as tc prints it (rounded to its clock's ticks: 262125b, 32Kb)."""
    import re

    number, unit = re.search(r"burst (\d+)(b|Kb|Mb)", qdiscs).groups()
    return int(number) * {"b": 1, "Kb": 1024, "Mb": 2**20}[unit]


def _gso(namespace: str, device: str) -> int:
    out = subprocess.run(
        ["ip", "-n", namespace, "-d", "-json", "link", "show", device],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)[0]["gso_max_size"]


@needs_root
def test_a_cluster_is_built_as_its_options_say(clean):
    """Egress-only shaping with a large burst and offloads on (a NIC's rate limit on a host
    with TSO), hosts sharing every core; against the default build."""
    cores = len(os.sched_getaffinity(0))
    argv = ["--hosts", "2", "--link", "1gbit"]
    made = run("cluster", "up", clean, *argv, "--shaping", "egress", "--burst", "256k",
               "--offload", "on", "--cores-per-host", str(cores))  # fmt: skip
    assert made.returncode == 0, made.stderr
    try:
        assert "shaping egress, burst 256KiB, offload on" in made.stdout
        built = cluster.load(clean)
        assert built.cores[0] == built.cores[1] == tuple(sorted(os.sched_getaffinity(0)))
        host, switch = built.namespace(1), built.switch
        assert _burst(_qdiscs(host, "eth0")) == pytest.approx(256 * 1024, rel=0.01)
        assert "tbf" not in _qdiscs(switch, "h1")  # the switch port does not shape
        assert _gso(host, "eth0") == 65536
    finally:
        run("cluster", "down", clean)
    other = f"{clean}b"[:8]
    made = run("cluster", "up", other, *argv)
    assert made.returncode == 0, made.stderr
    try:
        built = cluster.load(other)
        host, switch = built.namespace(1), built.switch
        assert _burst(_qdiscs(host, "eth0")) == pytest.approx(32 * 1024, rel=0.01)
        assert "tbf" in _qdiscs(switch, "h1")
        assert _gso(host, "eth0") == 16384
    finally:
        run("cluster", "down", other)


@needs_root
def test_the_job_status_is_the_exit_status_and_failures_clean_up(clean):
    exits = run(
        "cluster", "run", "--name", clean, "--", sys.executable, "-c", "raise SystemExit(3)"
    )
    assert exits.returncode == 3
    missing = run("cluster", "run", "--name", clean, "--", "no-such-command-here")
    assert missing.returncode != 0
    bad = run("cluster", "run", "--link", "fast", "--", "true")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--link" in bad.stderr
    empty = run("cluster", "run", "--hosts", "2")
    assert empty.returncode == 2 and "no command" in empty.stderr


@needs_root
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_takes_its_cluster_down(clean, how):
    job = subprocess.Popen(
        legion_nn("cluster", "run", "--name", clean, "--hosts", "2", "--", "sleep", "60"),
        env=environment(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            cluster.cluster_of(n) == clean for n in namespaces()
        ):
            time.sleep(0.05)
        time.sleep(1.0)  # mpiexec and the sleeps are up
        # Ctrl-C reaches the whole foreground group; a SIGTERM only the command
        os.killpg(job.pid, how) if how == signal.SIGINT else job.send_signal(how)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "Traceback" not in job.stderr.read()


@needs_root
def test_a_terminated_cluster_benchmark_takes_its_clusters_and_files_down():
    """`bench scaling --hosts` brings clusters up itself: a SIGTERM in the middle of it (a CI
    timeout, a scheduler) leaves no namespace and no working directory behind."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("legion-nn-cluster-scaling-*"))
    job = subprocess.Popen(
        legion_nn("bench", "scaling", "--hosts", "2", "--link", "1gbit", "--network",
                  "seed-lcn-small", "--batch", "8", "--strategies", "data"),
        env=environment(), stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    name = f"s{job.pid % 10_000_000}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            cluster.cluster_of(n) == name for n in namespaces()
        ):
            time.sleep(0.05)
        assert any(cluster.cluster_of(n) == name for n in namespaces())
        time.sleep(1.0)
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in job.stderr.read()
    assert not [n for n in namespaces() if cluster.cluster_of(n) == name]
    assert set(Path(tempfile.gettempdir()).glob("legion-nn-cluster-scaling-*")) == before


@needs_root
def test_up_run_on_status_and_down(clean):
    name = clean
    made = run("cluster", "up", name, "--hosts", "3", "--link", "500mbit")
    assert made.returncode == 0, made.stderr
    try:
        again = run("cluster", "up", name, "--hosts", "2")
        assert again.returncode == 2 and "exists" in again.stderr
        listed = json.loads(run("cluster", "status", "--json").stdout)
        entry = next(e for e in listed if e["name"] == name)
        assert entry["hosts"] == 3 and entry["link"] == "500mbit"
        assert len(entry["namespaces"]) == 4
        job = run("cluster", "run", "--on", name, "-n", "3", "--", "hostname")
        assert job.returncode == 0, job.stderr
        assert sorted(job.stdout.split()) == [f"{name}-h{h}" for h in range(3)]
    finally:
        down = run("cluster", "down", name)
    assert down.returncode == 0, down.stderr
    assert not [
        e for e in json.loads(run("cluster", "status", "--json").stdout) if e["name"] == name
    ]


@needs_root
def test_leftovers_of_a_killed_run_are_found_and_removed(clean):
    name = clean
    job = subprocess.Popen(
        legion_nn("cluster", "run", "--name", name, "--hosts", "2", "--", "sleep", "60"),
        env=environment(),
    )
    try:
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and len([n for n in namespaces() if cluster.cluster_of(n) == name]) < 3
        ):
            time.sleep(0.05)
        time.sleep(1.0)
        job.kill()  # the run cannot clean up after a SIGKILL
        job.wait(timeout=10)
        entry = next(e for e in cluster.status() if e["name"] == name)
        assert len(entry["namespaces"]) == 3 and entry["processes"] > 0
    finally:
        removed = run("cluster", "down", name)
    assert removed.returncode == 0, removed.stderr
    assert not [n for n in namespaces() if cluster.cluster_of(n) == name]


@needs_root
def test_bench_machine_measures_the_link_between_hosts(clean, tmp_path):
    path = tmp_path / "machine.json"
    result = run(
        "cluster", "run", "--name", clean, "--hosts", "2", "--link", "400mbit", "-n", "2", "--",
        *legion_nn("bench", "machine", "--network", "seed-lcn-small", "--batch", "4", "--quick",
                   "--quiet", "--eviction", cheapest_cold(), "--json", str(path)),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(path.read_text())
    assert data["hosts"] == 2 and data["ranks_per_host"] == 1
    assert data["measured_on"]["links_measured"] == ["inter_host"]
    assert data["measured_on"]["hosts"] == [f"{clean}-h0", f"{clean}-h1"]
    # tbf lets no more through than its rate (400 Mbit/s = 0.05 GB/s), each way and both at once
    assert 0 < data["link_gbytes_per_s"] <= 0.05 * 1.1
    assert 0 < data["duplex_gbytes_per_s"] <= 0.05 * 1.1
    assert "intra_host" not in data
    # the exchanges are kept by size, each at most the tbf rate each way
    exchanges = [p for p in data["pingpong"] if p["pair"] == "duplex"]
    assert {p["pair"] for p in data["pingpong"]} == {"inter_host", "duplex"}
    assert exchanges and all(p["bytes"] >= 1 << 20 for p in exchanges)
    assert all(p["bytes"] / p["seconds"] <= 0.05e9 * 1.1 for p in exchanges)
    # the default build's burst: two 16 KiB segments (what tbf lets through at once)
    assert 8 * 1024 < data["link_burst_bytes"] < 128 * 1024
    # moving bytes costs a host's core something, and far less than the link's time for them
    assert 0 < data["network_cpu_ns_per_byte"] < 1e9 / (0.05e9) / 2
    # the progress thread keeps up with a slow link while a kernel runs: nothing is held back
    assert "computing_gbytes_per_s" not in data and "computing_send_gbytes_per_s" not in data
    rounds = data["measured_on"]["message_overhead_rounds_us"]
    assert len(rounds) == 3 and data["message_overhead_us"] == sorted(rounds)[1] >= 0
    # each fit's job: its measured step, and its step alone measured and simulated
    steps = data["measured_on"]["message_job_steps_s"]
    assert len(steps) == 3 and all(len(row) == 3 and min(row) > 0 for row in steps)
