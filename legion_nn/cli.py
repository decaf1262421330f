"""The `legion-nn` command: one sub-command per module in `legion_nn.commands`.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`, and
imports the heavier packages (partitioner, runtime, visualize) inside `run`, so `legion-nn --help`
stays fast. Every `LegionNNError` and every bad file becomes one line on stderr and exit status 2;
nothing a user can cause ends in a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("bench", "cluster", "graph", "memory", "partition", "render", "trace", "train")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="legion-nn",
        description="Compile networks to Legion-style task graphs, partition them, train them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"legion_nn.commands.{name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from legion_nn.errors import LegionNNError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except LegionNNError as exc:
        print(f"legion-nn {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"legion-nn {args.command}: {exc.filename or ''}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"legion-nn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
