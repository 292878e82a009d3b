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
# Commands whose module is imported alone when the command line names them: a cold `ampd plan`
# must not pay for the launcher's gRPC and Redis imports (docs/planner.md, "Planning time").
_ONLY = {"plan": "ampd.planner.cli", "simulate": "ampd.sim.cli", "trace": "ampd.workload.cli"}
# Commands that simulate, on the compiled cores where they are built (ampd/compiled.py).
_COMPILED = ("simulate", "plan")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, never a traceback."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone where ``_ONLY`` names its module."""
    parser = argparse.ArgumentParser(prog="ampd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in (_ONLY[command],) if command in _ONLY else _COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a part of the tree not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _COMPILED:
        from ampd import compiled

        compiled.install()
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"ampd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
