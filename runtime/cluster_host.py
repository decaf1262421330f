"""Enter a host of an emulated cluster and run a command there: the cluster's `ssh`.

Hydra's ssh launcher runs `LAUNCHER [-x] HOST COMMAND...` with COMMAND as words for the remote
shell; the cluster's launcher script runs `python -m runtime.cluster_host CLUSTER` with those
arguments. It joins the host's network namespace (`nsenter`) and unshares a new IPC, UTS and
mount namespace (`unshare`), then, inside (`--inside`), names the host, gives it a private
`/dev/shm` and the cluster's `/etc/hosts`, binds it to the host's cores and hands COMMAND to
`sh -c`, as sshd would. The mount namespace is private, so none of this shows outside; it and
its tmpfs are gone when the last process on the host ends.

This module imports nothing heavy: it starts once per host per job.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from pathlib import Path

STATE_ROOT = Path("/run/legion-nn/clusters")
PREFIX = "lnn-"
SUBNET = "198.18.0"
_MS_BIND = 4096


def namespace_name(cluster: str, host: int) -> str:
    return f"{PREFIX}{cluster}-h{host}"


def hostname(cluster: str, host: int) -> str:
    return f"{cluster}-h{host}"


def address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def _fail(message: str) -> None:
    print(f"legion-nn cluster: {message}", file=sys.stderr)
    sys.exit(255)  # what ssh returns when it cannot reach the host


def _split(argv: list[str]) -> tuple[str, list[str]]:
    """(host, command) from ssh-style arguments: options such as hydra's `-x` come first."""
    words = list(argv)
    while words and words[0].startswith("-"):
        words.pop(0)
    if len(words) < 2:
        _fail("launcher: usage: CLUSTER [-x] HOST COMMAND...")
    return words[0], words[1:]


def host_index(cluster: str, hosts: int, name: str) -> int | None:
    """The host called `name` (its hostname or address), or None."""
    for host in range(hosts):
        if name in (hostname(cluster, host), address(host)):
            return host
    return None


def _mount(libc: ctypes.CDLL, source: str, target: str, kind: str | None, flags: int, data: str):
    if libc.mount(source.encode(), target.encode(), kind and kind.encode(), flags, data.encode()):
        _fail(f"cannot mount {target}: {os.strerror(ctypes.get_errno())}")


def enter(cluster: str, argv: list[str]) -> None:
    """Re-run this module `--inside` the host's namespaces."""
    try:
        state = json.loads((STATE_ROOT / cluster / "cluster.json").read_text())
    except (OSError, json.JSONDecodeError):
        _fail(f"cluster {cluster}: not up (`legion-nn cluster status`)")
    name, command = _split(argv)
    host = host_index(cluster, state["hosts"], name)
    if host is None:
        _fail(f"cluster {cluster}: no host {name!r}")
    namespace = f"/run/netns/{namespace_name(cluster, host)}"
    os.execvp(
        "nsenter",
        ["nsenter", f"--net={namespace}", "--", "unshare", "--ipc", "--uts", "--mount",
         "--propagation", "private", "--", sys.executable, "-m", "runtime.cluster_host",
         "--inside", cluster, str(host), *command],
    )  # fmt: skip


def inside(cluster: str, host: int, command: list[str]) -> None:
    state = json.loads((STATE_ROOT / cluster / "cluster.json").read_text())
    libc = ctypes.CDLL(None, use_errno=True)
    socket.sethostname(hostname(cluster, host))
    _mount(libc, "tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777")
    _mount(libc, str(STATE_ROOT / cluster / "hosts"), "/etc/hosts", None, _MS_BIND, "")
    os.sched_setaffinity(0, state["cores"][host])
    os.execvp("sh", ["sh", "-c", " ".join(command)])


def main(argv: list[str]) -> None:
    if argv[:1] == ["--inside"] and len(argv) >= 4:
        inside(argv[1], int(argv[2]), argv[3:])
    elif argv:
        enter(argv[0], argv[1:])
    else:
        _fail("launcher: usage: CLUSTER [-x] HOST COMMAND...")


if __name__ == "__main__":
    main(sys.argv[1:])
