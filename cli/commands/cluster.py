"""`legion-nn cluster run|up|down|status`: an emulated cluster on one Linux machine (root).

    legion-nn cluster run --hosts 2 --link 1gbit -n 4 -- legion-nn train --strategy model

brings up 2 hosts (network namespaces behind a switch, each host's link limited to 1 Gbit/s each
way), runs one `mpiexec` job of 4 ranks across them (2 per host), takes everything down on every
exit path and exits with the job's status. `up NAME` keeps a cluster for a session, `run --on
NAME` runs jobs on it, `status` lists clusters (and leftovers of killed runs), `down NAME`
removes one. `run --max-restarts K` starts a training job that fails again from its newest
checkpoint, as `legion-nn launch` does. See `runtime.cluster` for what a host and a link are.
"""

from __future__ import annotations

import argparse
import json
import sys

from cli.commands.launch import add_max_restarts, job_words

NAME = "cluster"
HELP = "an emulated cluster on this machine (root): hosts as namespaces, links limited by tc"


def _hosts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=2, metavar="H", help="hosts (default 2)")
    parser.add_argument(
        "--link",
        default="1gbit",
        metavar="RATE",
        help="each host's link, each way: 1gbit, 500mbit, 10gbit, unlimited (default 1gbit)",
    )
    parser.add_argument(
        "--shaping",
        metavar="egress|both",
        help="limit each link where the host sends only, or at both ends (default both: a host "
        "also receives at most the rate)",
    )
    parser.add_argument(
        "--burst",
        metavar="B",
        help="the token bucket's burst, e.g. 32k or 256KiB (default: 50 us of the rate, at "
        "least two segments)",
    )
    parser.add_argument(
        "--offload",
        metavar="on|off",
        help="segmentation offloads: on hands the link the kernel's 64 KiB super-packets, off "
        "caps segments at 16 KiB (default off)",
    )
    parser.add_argument(
        "--cores-per-host",
        type=int,
        metavar="C",
        help="cores each host runs on (default: an even share, each host its own); more than "
        "an even share makes hosts share cores",
    )


#: the options that build a cluster, which `run --on` cannot change
_BUILD_FLAGS = (("--shaping", "shaping"), ("--burst", "burst"), ("--offload", "offload"),
                ("--cores-per-host", "cores_per_host"))  # fmt: skip


def _options(args: argparse.Namespace, link: float | None):
    from runtime import cluster_links

    return cluster_links.link_options(
        link, args.shaping, args.burst, args.offload, args.cores_per_host
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", required=True, metavar="run|up|down|status")
    run = sub.add_parser(
        "run",
        help="bring up a cluster, run one mpiexec job across it, take it down",
        description="Bring up a cluster, run COMMAND as one mpiexec job of R ranks placed in "
        "blocks over the hosts, take the cluster down and exit with the job's status.",
    )
    _hosts(run)
    run.add_argument(
        "-n", type=int, default=None, metavar="R", help="ranks (default: one per host)"
    )
    run.add_argument("--on", metavar="NAME", help="run on the cluster NAME (from `up`) instead")
    run.add_argument("--name", help="name the run's cluster (default r<pid>)")
    add_max_restarts(run)
    # not `command`: the top-level parser names the subcommand so, for its error lines
    run.add_argument(
        "job", nargs=argparse.REMAINDER, metavar="command", help="-- COMMAND... run on every rank"
    )
    up = sub.add_parser("up", help="bring up a cluster and keep it", description=up_help())
    up.add_argument("name", help="1-8 lower-case letters and digits")
    _hosts(up)
    down = sub.add_parser("down", help="remove a cluster, or every one (--all)")
    down.add_argument("name", nargs="?", help="the cluster")
    down.add_argument("--all", action="store_true", help="every cluster and leftover found")
    status = sub.add_parser("status", help="clusters and leftovers on this machine")
    status.add_argument("--json", action="store_true", help="as JSON")


def up_help() -> str:
    return (
        "Bring up a cluster NAME and keep it, for `cluster run --on NAME`; remove it with "
        "`cluster down NAME`."
    )


def _say(line: str) -> None:
    print(f"legion-nn cluster run: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from functools import partial

    from legion_nn.errors import LegionNNError
    from runtime import cluster, cluster_links
    from runtime.restarts import check_restartable, run_with_restarts

    command = args.cluster_command
    if command == "status":
        found = cluster.status()
        if args.json:
            print(json.dumps(found))
        for entry in [] if args.json else found:
            details = ", ".join(f"{k} {v}" for k, v in entry.items() if k not in ("name",))
            print(f"{entry['name']}: {details}")
        if not found and not args.json:
            print("no clusters")
        return 0
    if command == "down":
        if bool(args.name) == bool(args.all):
            raise LegionNNError("down: name a cluster or give --all")
        names = [args.name] if args.name else [e["name"] for e in cluster.status()]
        for name in names:
            removed = cluster.down(name)
            print(f"{name}: removed {len(removed)} namespace(s)")
        return 0
    link = cluster_links.parse_rate(args.link)
    if command == "up":
        made = cluster.up(args.name, args.hosts, link, _options(args, link))
        print(f"{made.name}: {made.describe()}")
        return 0
    words = job_words(args, "legion-nn cluster run ... -- COMMAND...")
    if args.on:
        given = [flag for flag, key in _BUILD_FLAGS if getattr(args, key) is not None]
        if given:
            raise LegionNNError(
                f"run --on {args.on}: {given[0]} builds a cluster; {args.on} was built by `up`"
            )
        on = cluster.load(args.on)
        job = partial(cluster.execute, on, args.n or on.hosts)
        code = run_with_restarts(job, words, args.max_restarts, _say)
    else:
        options = _options(args, link)
        check_restartable(words, args.max_restarts)
        code = cluster.run(
            args.hosts, link, args.n or args.hosts, words, args.name, options,
            args.max_restarts, _say,
        )  # fmt: skip
    sys.stdout.flush()
    return code
