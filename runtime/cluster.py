"""An emulated cluster on one Linux machine: hosts as namespaces, real links, one `mpiexec` job.

Partitioning trades compute against communication, and on one host MPI moves bytes through shared
memory at many GB/s. To see what a plan costs where links are slow, `legion-nn cluster` builds a
small cluster out of the kernel's namespaces (Mininet's approach) and runs the real runtime on it,
over real TCP:

- **a host** is a network namespace `lnn-<cluster>-h<i>` with one interface, `eth0`, at
  198.18.0.<i+1>/24 (the benchmarking range, RFC 2544). Every process started on it also gets its
  own IPC namespace, its own hostname `<cluster>-h<i>` (what MPI's locality test compares), a
  private `/dev/shm` and an `/etc/hosts` naming the cluster's hosts (`runtime.cluster_host`). The
  file system is shared, as a cluster's shared file system is. Each host runs on its own share of
  this machine's cores (contiguous, `split_sizes` of the allowed cores), so that two hosts do not
  time-share a core the way two real ones never would;
- **the network** is a switch namespace `lnn-<cluster>-sw` holding a bridge, with a veth pair per
  host. Each host's link is limited to the rate in both directions by a token bucket (`tbf`) at
  each end of its pair: full duplex per host behind a non-blocking switch. (`netem` is missing on
  some kernels; `tbf` is not);
- **a job** is one `mpiexec` on the first host, started with `-launcher ssh -launcher-exec` pointed
  at a launcher that enters the named host instead of logging in to it. Hydra then runs one proxy
  per host, as on a real cluster, and MPICH sees distinct nodes: shared memory within a host,
  libfabric's `tcp` provider over `eth0` between hosts. Ranks are placed in blocks, host by host.

Nothing outside the namespaces it made is touched: the cluster's state lives in
`/run/legion-nn/clusters/<name>/`, and `down` kills what runs on its hosts and deletes its
namespaces (their veths go with them). `run` brings a cluster up and takes it down on every exit
path; leftovers of a run that was itself killed are listed by `status` and removed by `down`.
Names are never reused silently: `up` refuses a name that exists. Everything is done with
iproute2's own commands; the only thing read back is `ip -json`'s output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.rect import split_sizes
from runtime.cluster_host import PREFIX, STATE_ROOT, address, hostname, namespace_name
from runtime.cluster_links import (
    GSO_MAX,
    LinkOptions,
    format_rate,
    tbf,
)
from runtime.restarts import exit_status, run_with_restarts

#: environment of every job: MPICH's libfabric netmod over TCP on the hosts' one interface (its
#: default netmod here is UCX, whose shared-memory transports would reach across hosts)
JOB_ENVIRONMENT = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
MAX_HOSTS = 64


@dataclass(frozen=True)
class Cluster:
    name: str
    hosts: int
    #: bits per second of each host's link, each way; None: unlimited
    link_bits: float | None
    #: per host, the cores its processes run on
    cores: tuple[tuple[int, ...], ...]
    options: LinkOptions = LinkOptions()

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    def namespace(self, host: int) -> str:
        return namespace_name(self.name, host)

    def hostname(self, host: int) -> str:
        return hostname(self.name, host)

    def address(self, host: int) -> str:
        return address(host)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(self.namespace(h) for h in range(self.hosts))]

    @property
    def directory(self) -> Path:
        return STATE_ROOT / self.name

    @property
    def launcher(self) -> Path:
        return self.directory / "launcher"

    @property
    def hosts_file(self) -> Path:
        return self.directory / "hosts"

    def placement(self, ranks: int) -> list[int]:
        """Ranks per host, in blocks: 3 ranks on 2 hosts are 2 then 1."""
        return split_sizes(ranks, self.hosts)

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.hosts} hosts, link {format_rate(self.link_bits)}, {self.options.describe()}"


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise LegionNNError(
            f"cluster name {name!r}: use 1-8 lower-case letters and digits, starting with a letter"
        )
    return name


def require() -> None:
    """One line naming what is missing, where something is."""
    if os.geteuid() != 0:
        raise LegionNNError("cluster: needs root (namespaces and links); run as root or with sudo")
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        raise LegionNNError(
            f"cluster: {' and '.join(missing)} not found: install iproute2 and util-linux "
            "(apt-get install iproute2 util-linux)"
        )


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    return _tool(command, check)


def _tool(command: Sequence[str], check: bool = True) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise LegionNNError(f"cluster: `{' '.join(command)}`: {why}")
    return result.stdout


def host_cores(
    hosts: int, allowed: Sequence[int] | None = None, per_host: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Each host's cores: this process's allowed cores in contiguous shares; with more hosts
    than cores, hosts share cores round-robin. `per_host` cores each instead: host h takes the
    `per_host` cores from h·per_host on, wrapping around, so hosts share cores where they must."""
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if per_host is not None:
        return tuple(
            tuple(sorted({cores[(h * per_host + i) % len(cores)] for i in range(per_host)}))
            for h in range(hosts)
        )
    if hosts <= len(cores):
        out, start = [], 0
        for size in split_sizes(len(cores), hosts):
            out.append(tuple(cores[start : start + size]))
            start += size
        return tuple(out)
    return tuple((cores[h % len(cores)],) for h in range(hosts))


def existing_namespaces() -> list[str]:
    """This machine's network namespaces that legion-nn clusters made."""
    raw = _tool(["ip", "-json", "netns", "list"]).strip()
    names = [entry["name"] for entry in json.loads(raw)] if raw else []
    return sorted(name for name in names if name.startswith(PREFIX))


def cluster_of(namespace: str) -> str:
    return namespace[len(PREFIX) :].rsplit("-", 1)[0]


def up(
    name: str, hosts: int, link_bits: float | None, options: LinkOptions = LinkOptions()
) -> Cluster:
    """Create the cluster `name`; on any failure, remove what was made and raise."""
    require()
    check_name(name)
    if not 1 <= hosts <= MAX_HOSTS:
        raise LegionNNError(f"--hosts: expected 1 to {MAX_HOSTS}, got {hosts}")
    cores = host_cores(hosts, per_host=options.cores_per_host)
    cluster = Cluster(name, hosts, link_bits, cores, options)
    if cluster.directory.exists() or any(cluster_of(n) == name for n in existing_namespaces()):
        raise LegionNNError(
            f"cluster {name} exists (`legion-nn cluster status`); take it down first "
            f"(`legion-nn cluster down {name}`)"
        )
    cluster.directory.mkdir(parents=True)
    try:
        _write_state(cluster)
        _build_network(cluster)
    except BaseException:
        down(name)
        raise
    return cluster


def _write_state(cluster: Cluster) -> None:
    lines = [f"{cluster.address(h)} {cluster.hostname(h)}" for h in range(cluster.hosts)]
    cluster.hosts_file.write_text("\n".join(["127.0.0.1 localhost", *lines]) + "\n")
    # hydra runs `-launcher-exec` as a program: a script that enters the named host
    cluster.launcher.write_text(
        f'#!/bin/sh\nexec {sys.executable} -m runtime.cluster_host {cluster.name} "$@"\n'
    )
    cluster.launcher.chmod(0o755)
    (cluster.directory / "cluster.json").write_text(json.dumps(cluster.to_json()) + "\n")


def _build_network(cluster: Cluster) -> None:
    switch = cluster.switch
    _ip("netns", "add", switch)
    _ip("link", "set", "lo", "up", namespace=switch)
    _ip("link", "add", "br0", "type", "bridge", namespace=switch)
    _ip("link", "set", "br0", "up", namespace=switch)
    for host in range(cluster.hosts):
        namespace, port = cluster.namespace(host), f"h{host}"
        _ip("netns", "add", namespace)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace,
            namespace=switch)  # fmt: skip
        _ip("link", "set", port, "master", "br0", "up", namespace=switch)
        _ip("addr", "add", f"{cluster.address(host)}/24", "dev", "eth0", namespace=namespace)
        if not cluster.options.offload:
            for device, where in (("eth0", namespace), (port, switch)):
                _ip("link", "set", device, "gso_max_size", str(GSO_MAX), namespace=where)
        _ip("link", "set", "eth0", "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        if cluster.link_bits is not None:
            shape = tbf(cluster.link_bits, cluster.options)
            _tool(["tc", "-n", namespace, "qdisc", "add", "dev", "eth0", "root", *shape])
            if cluster.options.shaping == "both":
                _tool(["tc", "-n", switch, "qdisc", "add", "dev", port, "root", *shape])


def load(name: str) -> Cluster:
    path = STATE_ROOT / check_name(name) / "cluster.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise LegionNNError(
            f"cluster {name}: not found or incomplete (`legion-nn cluster status`)"
        ) from None
    return Cluster(
        data["name"],
        data["hosts"],
        data["link_bits"],
        tuple(tuple(c) for c in data["cores"]),
        LinkOptions(**data.get("options", {})),
    )


def _pids_in(namespace: str) -> list[int]:
    out = _tool(["ip", "netns", "pids", namespace], check=False)
    return [int(word) for word in out.split() if word.isdigit()]


def down(name: str) -> list[str]:
    """Kill everything running on cluster `name`'s hosts, delete its namespaces and state; the
    namespaces removed."""
    require()
    check_name(name)
    namespaces = [n for n in existing_namespaces() if cluster_of(n) == name]
    for _ in range(50):
        pids = [pid for namespace in namespaces for pid in _pids_in(namespace)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    for namespace in namespaces:
        _ip("netns", "del", namespace)
    shutil.rmtree(STATE_ROOT / name, ignore_errors=True)
    return namespaces


def status() -> list[dict]:
    """Every cluster found: from its state, or from namespaces a killed run left behind."""
    require()
    found: dict[str, dict] = {}
    if STATE_ROOT.is_dir():
        for directory in sorted(STATE_ROOT.iterdir()):
            try:
                cluster = load(directory.name)
                found[cluster.name] = {
                    "name": cluster.name,
                    "hosts": cluster.hosts,
                    "link": format_rate(cluster.link_bits),
                    "shaping": cluster.options.shaping,
                    "burst": cluster.options.burst_bytes or "default",
                    "offload": "on" if cluster.options.offload else "off",
                    "cores": [list(c) for c in cluster.cores],
                }
            except LegionNNError:
                found[directory.name] = {"name": directory.name, "state": "incomplete"}
    for namespace in existing_namespaces():
        entry = found.setdefault(
            cluster_of(namespace), {"name": cluster_of(namespace), "state": "no state: leftover"}
        )
        entry.setdefault("namespaces", []).append(namespace)
        entry.setdefault("processes", 0)
        entry["processes"] += len(_pids_in(namespace))
    return list(found.values())


def mpiexec_command(cluster: Cluster, ranks: int, command: Sequence[str]) -> list[str]:
    """The `mpiexec` that runs `command` as `ranks` ranks across the cluster's hosts."""
    hosts = ",".join(
        f"{cluster.hostname(h)}:{count}"
        for h, count in enumerate(cluster.placement(ranks))
        if count
    )
    return [
        "mpiexec", "-launcher", "ssh", "-launcher-exec", str(cluster.launcher),
        "-hosts", hosts, "-n", str(ranks), *command,
    ]  # fmt: skip


def job_command(cluster: Cluster, ranks: int, command: Sequence[str]) -> list[str]:
    """`mpiexec_command`, started on the cluster's first host. The launcher takes a command
    the way ssh does, as words for the host's shell, so each word is quoted."""
    words = mpiexec_command(cluster, ranks, command)
    return [str(cluster.launcher), cluster.hostname(0), *map(shlex.quote, words)]


def job_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    return {**(os.environ if base is None else base), **JOB_ENVIRONMENT}


def execute(cluster: Cluster, ranks: int, command: Sequence[str]) -> int:
    """Run the job in the foreground; its exit status (128 + n for signal n)."""
    if shutil.which("mpiexec") is None:
        raise LegionNNError("cluster: mpiexec not found (pip install mpich)")
    job = subprocess.Popen(job_command(cluster, ranks, command), env=job_environment())
    try:
        code = job.wait()
    except BaseException:
        job.terminate()
        try:
            job.wait(timeout=5)
        except subprocess.TimeoutExpired:
            job.kill()
        raise
    return exit_status(code)


class Terminated(Exception):
    """SIGTERM arrived while a cluster was up (`terminated_cleanly`)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def terminated_cleanly() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside the block, so that the `finally` clauses that take
    clusters down run (Python's default for SIGTERM ends the process without them)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(
    hosts: int,
    link_bits: float | None,
    ranks: int,
    command: Sequence[str],
    name: str | None = None,
    options: LinkOptions = LinkOptions(),
    max_restarts: int = 0,
    say: Callable[[str], None] = print,
) -> int:
    """Bring a cluster up (`name`, default r<pid>), run one job on it (again from its newest
    checkpoint when it fails, `max_restarts` times at most: `runtime.restarts`), take it down on
    every exit path; the last run's status."""
    require()
    if ranks < 1:
        raise LegionNNError(f"-n: expected a positive rank count, got {ranks}")
    name = name or f"r{os.getpid() % 10_000_000}"
    try:
        with terminated_cleanly():
            cluster = up(name, hosts, link_bits, options)
            try:
                job = partial(execute, cluster, ranks)
                return run_with_restarts(job, command, max_restarts, say)
            finally:
                down(name)
    except Terminated:
        return 128 + signal.SIGTERM
