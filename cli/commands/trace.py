"""`legion-nn trace summary F [--json OUT]`: busy, communicating and idle time per rank, and the
critical path, of a Chrome trace written by the MPI runtime (`legion-nn/trace-v1`).

The reading is `visualize.trace_file`'s, the analysis `visualize.trace_summary`'s; this module
parses the command line, prints the text and writes the JSON (atomically).
"""

from __future__ import annotations

import argparse
import json
import sys

NAME = "trace"
HELP = "summarise a training trace (Chrome trace JSON from `legion-nn train --trace`)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="summary")
    summary = sub.add_parser(
        "summary",
        help="per rank busy, communicating and idle time, and the critical path",
        description="Per rank busy, communicating and idle time, and the critical path, "
        "of a legion-nn/trace-v1 Chrome trace.",
    )
    summary.add_argument("trace", metavar="F", help="the trace JSON")
    summary.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    summary.add_argument(
        "--path-rows",
        type=int,
        default=40,
        metavar="N",
        help="critical-path stretches printed before eliding the middle (default 40)",
    )


def run(args: argparse.Namespace) -> int:
    from legion_nn.atomic import write_text
    from legion_nn.errors import LegionNNError
    from visualize.trace_file import load_trace
    from visualize.trace_summary import format_summary, summary

    if args.path_rows < 11:
        raise LegionNNError(f"--path-rows must be at least 11, got {args.path_rows}")
    report = summary(load_trace(args.trace))
    if args.json:
        write_text(args.json, json.dumps(report, indent=1) + "\n")
    sys.stdout.write(format_summary(report, args.trace, args.path_rows))
    return 0
