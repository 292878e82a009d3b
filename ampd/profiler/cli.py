"""`ampd profile`: time an engine, fit the performance model, write the profile file if it passes."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from ampd.cli import CliError


def register(subparsers) -> None:
    from ampd import config

    p = subparsers.add_parser(
        "profile", help="measure an engine and fit its performance profile (piecewise alpha-beta)",
        description="Times prefill over (l_hist, l_incr), decode steps over batch sizes and contexts, and "
                    "KV transfer over sizes through NIXL, through the engine's own Engine protocol; fits the "
                    "piecewise alpha-beta model; measures its error on held-out points that were not fitted "
                    "and writes the profile only if that error and the pieces' shapes pass (docs/planner.md).")
    p.add_argument("--report", metavar="F",
                   help="print the held-out errors of the saved profile F (measured by this command) against its "
                        "own fit, and how it was measured; times nothing")
    p.add_argument("--engine", metavar="E",
                   help="engine to time: torch (the model of --model on this machine's CPU), sglang (where "
                        "its extra is installed) or mock (timed by --profile)")
    p.add_argument("--profile", metavar="P", help="for --engine mock: the profile that times it (name or file)")
    p.add_argument("--tp", metavar="N[,N...]", help="TP degrees to profile (default: 1; mock: every degree of "
                                                     "its profile)")
    p.add_argument("--out", metavar="F",
                   help="profile file to write (JSON); a refused profile leaves an existing F as it was")
    p.add_argument("--name", metavar="MODEL@HARDWARE", help="name of the new profile (default MODEL@HARDWARE-ENGINE)")
    p.add_argument("--grid", default="full", choices=("tiny", "small", "full"),
                   help="grid size: tiny (seconds; tests), small, full (default; a torch profile of SmolLM2 "
                        "takes a few minutes on 2 cores). Sizes suit where the engine computes (CPU or GPU)")
    p.add_argument("--reps", type=int, metavar="R", help="runs per point, the fastest is kept (more for points "
                                                         "a held-out check doubts); default the grid's (2-3)")
    config.add_flags(p, config.PROFILE_SETTINGS)
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
    first = [0.0]  # when the first run ended: loading the model and the histories is not the pace

    def tick(done: int, total: int) -> None:
        now = time.monotonic()
        first[0] = first[0] or now
        if done == total or now - last[0] >= (0.2 if tty else 10.0):
            last[0] = now
            el = now - t0
            pace = (now - first[0]) / (done - 1) if done > 1 else 0.0
            eta = f", ~{pace * (total - done):.0f} s left" if 1 < done < total else ""
            msg = f"profile: {done}/{total} timed runs ({el:.0f} s{eta})"
            sys.stderr.write(("\r" + msg + ("\n" if done == total else "")) if tty else msg + "\n")
            sys.stderr.flush()
    return tick


def _note(message: str) -> None:
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + message + "\n")
    sys.stderr.flush()


def _write_atomic(path: str, document: dict) -> None:
    """The whole file or nothing: a crash mid-write leaves an existing profile as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


FLAGS = {"engine": "--engine", "--engine": "--engine", "profile": "--profile", "tp": "--tp", "model": "--model",
         "grid": "--grid"}


def report(path: str) -> int:
    """The saved profile's held-out errors, recomputed from its held-out samples and its own pieces (an
    edited file is judged as it now is), beside what the profiler recorded."""
    from ampd.perf import profile_from_dict
    from ampd.profiler.checks import held_out

    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        prof = profile_from_dict(doc, path)
    except OSError as exc:
        raise CliError(f"--report: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CliError(f"--report: {exc}") from None
    meta = doc.get("profiling") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or "held_out_samples" not in meta:
        raise CliError(f"--report: {path} holds no held-out samples (a shipped or hand-written profile, not "
                       "one `ampd profile` measured)")
    print(f"{prof.name}: engine {meta.get('engine')}, {meta.get('machine')}, compute threads "
          f"{meta.get('compute_threads')}, measured {meta.get('when')}, load {meta.get('loadavg_1m')}")
    for m in meta.get("merged_from", []):
        print(f"  merged run of {m.get('when')}, load {m.get('loadavg_1m')}, held-out max {m.get('held_out_max')}")
    model = {}
    for tp in prof.tps:
        model[f"tp.{tp}.t_pre"] = lambda lh, li, tp=tp: prof.t_pre(tp, lh, li)
        model[f"tp.{tp}.t_dec"] = lambda b, c, tp=tp: prof.t_dec(tp, b, c)
    model["t_kv"] = lambda s, d, n: prof.t_kv(n, s, d)
    limit = float(meta.get("max_held_out_error", 0.15))
    print(f"{'quantity':<12} {'held-out max':>13} {'mean':>8} {'points':>7}  worst point (measured / model)")
    worst = 0.0
    for q, pts in meta["held_out_samples"].items():
        if q not in model:
            continue
        e = held_out([tuple(x) for x in pts], model[q])
        worst = max(worst, e.max_rel)
        w = e.worst[0] if e.worst else None
        where = (f"{tuple(w[:-3])}: {w[-3] * 1e3:.2f} / {w[-2] * 1e3:.2f} ms" if w else "-")
        print(f"{q:<12} {e.max_rel:>13.1%} {e.mean_rel:>8.1%} {e.points:>7}  {where}")
    path_latency = meta.get("path_latency")
    if path_latency:
        print(f"path latency measured on the live deployment: {path_latency}")
    print(f"{'within' if worst <= limit else 'OUTSIDE'} the limit {limit:g} the profile was written under")
    return 0


def run(args) -> int:
    from ampd.profiler import profile_engine

    if args.report:
        return report(args.report)
    missing = [f for f, v in (("--engine", args.engine), ("--out", args.out)) if not v]
    if missing:
        raise CliError(f"{' and '.join(missing)}: required to profile (or give --report FILE to read a saved profile)")
    if args.reps is not None and args.reps < 1:
        raise CliError(f"--reps: must be >= 1, got {args.reps}")
    if os.path.isdir(args.out):
        raise CliError(f"--out: {args.out} is a folder; give a file name")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        print(f"profile: note: load average {load:.1f} on {cores} cores; other work will slow and scatter the "
              "timings (the held-out check judges them)", file=sys.stderr)
    try:
        result = profile_engine(args.engine, profile=args.profile, tps=_tps(args.tp), grid=args.grid,
                                reps=args.reps, name=args.name, model=args.model, block_tokens=args.block_tokens,
                                kv_pool_mb=args.kv_pool_mb, max_error=args.max_held_out_error,
                                progress=_progress(), note=_note)
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = FLAGS.get(field)
        raise CliError(f"{flag}: {msg}" if flag else str(exc)) from None
    except ImportError as exc:
        raise CliError(f"--engine {args.engine}: a module it needs did not load ({exc}); `make venv` installs "
                       "AMPD's dependencies (NIXL, torch)") from None
    print(f"profiled {result.profile.name} ({args.engine}) in {result.seconds:.1f} s")
    print(f"{'quantity':<12} {'held-out max':>13} {'mean':>8} {'points':>7}")
    for q, e in result.held_out.items():
        print(f"{q:<12} {e.max_rel:>13.1%} {e.mean_rel:>8.1%} {e.points:>7}")
    if result.problems:
        for p in result.problems:
            print(f"refused: {p}", file=sys.stderr)
        kept = "left as it was" if os.path.exists(args.out) else "not written"
        raise CliError(f"profile refused ({len(result.problems)} problem(s) above; limit --max-held-out-error "
                       f"{args.max_held_out_error:g}); {args.out} {kept}. A quieter machine, more --reps or "
                       "a denser --grid may pass")
    _write_atomic(args.out, result.document)
    print(f"wrote {args.out}")
    return 0
