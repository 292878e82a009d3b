"""`ampd profile`: time an engine, fit the performance model, write a profile file."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from ampd.cli import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="measure an engine and fit its performance profile (piecewise alpha-beta)",
        description="Times prefill over (l_hist, l_incr), decode steps over batch sizes and contexts, and "
                    "KV transfer over sizes through NIXL; fits the piecewise alpha-beta model by least "
                    "squares, prints the fit error of each function and writes the profile (with the fit "
                    "errors and samples under \"profiling\").")
    p.add_argument("--engine", required=True, metavar="E",
                   help="engine to time: mock (timed by --profile); torch and sglang plug in as they land")
    p.add_argument("--profile", metavar="P", help="for --engine mock: the profile that times it (name or file)")
    p.add_argument("--tp", metavar="N[,N...]", help="TP degrees to profile (default: every degree the engine has)")
    p.add_argument("--out", required=True, metavar="F", help="profile file to write (JSON)")
    p.add_argument("--name", metavar="MODEL@HARDWARE", help="name of the new profile (default MODEL@HARDWARE-ENGINE)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, not minutes)")
    p.add_argument("--reps", type=int, metavar="R", help="runs per point, the minimum is kept (default 3, quick 2)")
    p.add_argument("--no-validate", action="store_true", help="skip the held-out midpoints")
    p.set_defaults(func=run)


def _tps(text: str | None):
    if not text:
        return None
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CliError(f"--tp: expected comma-separated integers, got {text!r}") from None
    if any(t < 1 for t in out):
        raise CliError(f"--tp: degrees must be >= 1, got {text!r}")
    return out


def _progress():
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    last = [0.0]

    def tick(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= (0.2 if tty else 5.0):
            last[0] = now
            msg = f"profile: {done}/{total} points ({now - t0:.1f} s)"
            sys.stderr.write(("\r" + msg + ("\n" if done == total else "")) if tty else msg + "\n")
            sys.stderr.flush()
    return tick


def run(args) -> int:
    from ampd.profiler import DEFAULT_GRID, QUICK_GRID, profile_engine

    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    if args.reps is not None:
        if args.reps < 1:
            raise CliError(f"--reps must be >= 1, got {args.reps}")
        grid = dataclasses.replace(grid, reps=args.reps)
    if args.no_validate:
        grid = dataclasses.replace(grid, validate=False)
    try:
        result = profile_engine(args.engine, profile=args.profile, tps=_tps(args.tp), grid=grid, name=args.name,
                                progress=_progress())
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = {"engine": "--engine", "profile": "--profile", "tp": "--tp"}.get(field)
        raise CliError(f"{flag}: {msg}" if flag else str(exc)) from None
    except ImportError as exc:
        raise CliError(f"--engine {args.engine}: a KV transfer needs NIXL, which did not load: {exc}") from None
    print(f"profiled {result.profile.name} ({args.engine}) in {result.seconds:.1f} s")
    print(f"{'function':<16} {'fit max':>8} {'fit mean':>9} {'held-out max':>13} {'held-out mean':>14}")
    for fn, errs in result.errors.items():
        f, v = errs["fit"], errs["validation"]
        held = f"{v.max_rel:>12.2%} {v.mean_rel:>14.2%}" if v.points else f"{'-':>12} {'-':>14}"
        print(f"{fn:<16} {f.max_rel:>8.2%} {f.mean_rel:>9.2%} {held}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result.document, fh, indent=1)
        fh.write("\n")
    print(f"wrote {args.out}")
    return 0
