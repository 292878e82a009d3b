"""The `ampd` command. Each subcommand lives beside the code it drives and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# module path -> exposes `register(subparsers)`; each registered parser sets `func(args) -> int`.
_COMMANDS = (
    "ampd.workload.cli",
    "ampd.launcher",
    "ampd.chat.cli",
    "ampd.bench.cli",
    "ampd.sim.cli",
    "ampd.planner.cli",
    "ampd.profiler.cli",
)


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, never a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a part of the tree not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"ampd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
