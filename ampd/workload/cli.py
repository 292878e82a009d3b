"""`ampd trace ...`: generate, import and inspect session traces."""
from __future__ import annotations

import argparse
import json
import math
import sys

from ampd.cli import CliError

from .mooncake import import_mooncake
from .presets import PRESETS, generate
from .stats import format_stats, trace_stats
from .trace import TraceError, dump_trace, load_trace


def register(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="generate, import and inspect session traces",
                                  description="Generate, import and inspect session traces "
                                              "(JSON Lines, one session per line).")
    sub = trace.add_subparsers(dest="trace_command", required=True)

    gen = sub.add_parser("gen", help="generate a trace from a Table 1 preset")
    gen.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    gen.add_argument("--rate", required=True, type=_number("--rate"),
                     help="Poisson arrival rate, sessions/s (> 0)")
    gen.add_argument("--duration", required=True, type=_number("--duration"),
                     help="arrival window, seconds (> 0)")
    gen.add_argument("--seed", type=_integer("--seed"), default=0, help="random seed (default 0)")
    gen.add_argument("--out", required=True, help="output trace file (.jsonl, or .jsonl.gz)")
    gen.set_defaults(func=_gen)

    imp = sub.add_parser("import-mooncake", help="convert a Mooncake-style JSONL request trace")
    imp.add_argument("input", metavar="IN", help="Mooncake-style JSONL file")
    imp.add_argument("--out", required=True, help="output trace file")
    imp.set_defaults(func=_import)

    st = sub.add_parser("stats", help="per-session and per-round means of a trace")
    st.add_argument("trace", metavar="F", help="trace file")
    st.add_argument("--preset", help="also compare with this preset's Table 1 means")
    st.add_argument("--json", action="store_true", help="print the statistics as JSON")
    st.set_defaults(func=_stats)


class _ArgError(argparse.ArgumentTypeError):
    pass


def _number(flag: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise _ArgError(f"{flag} must be a number, got {text!r}") from None
        return v
    parse.__name__ = "number"
    return parse


def _integer(flag: str):
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise _ArgError(f"{flag} must be an integer, got {text!r}") from None
    parse.__name__ = "integer"
    return parse


def _check_preset(name: str | None) -> None:
    if name is not None and name not in PRESETS:
        raise CliError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")


def _gen(args) -> int:
    _check_preset(args.preset)
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise CliError(f"--rate must be a finite number > 0 sessions/s, got {args.rate:g}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise CliError(f"--duration must be a finite number > 0 seconds, got {args.duration:g}")
    if args.seed < 0:
        raise CliError(f"--seed must be >= 0, got {args.seed}")
    try:
        sessions = generate(args.preset, args.rate, args.duration, args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    n = _write(sessions, args.out)
    print(f"wrote {n} sessions to {args.out}")
    print(format_stats(trace_stats(sessions), PRESETS[args.preset].targets))
    return 0


def _import(args) -> int:
    try:
        sessions = import_mooncake(args.input)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot read {args.input}: {exc.strerror or exc}") from None
    n = _write(sessions, args.out)
    print(f"wrote {n} sessions to {args.out}")
    print(format_stats(trace_stats(sessions)))
    return 0


def _stats(args) -> int:
    _check_preset(args.preset)
    try:
        sessions = load_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot read {args.trace}: {exc.strerror or exc}") from None
    stats = trace_stats(sessions)
    targets = PRESETS[args.preset].targets if args.preset else None
    if args.json:
        if targets:
            stats["table1"] = targets
        json.dump(stats, sys.stdout, indent=2)
        print()
    else:
        print(format_stats(stats, targets))
    return 0


def _write(sessions, out: str) -> int:
    try:
        return dump_trace(sessions, out)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from None
