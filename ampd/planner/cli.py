"""`ampd plan`: the planner on a profile and a trace (docs/planner.md)."""
from __future__ import annotations

import json
import os
import sys
import time

from ampd.cli import CliError


def register(subparsers) -> None:
    from ampd.config import add_flags  # run() imports it anyway (through the simulator)

    p = subparsers.add_parser(
        "plan", help="choose how many prefill and decode GPUs at which TP degree (ILP on SCIP)",
        description="Plan a deployment for a trace on N GPUs: the ILP of docs/planner.md picks the best "
                    "candidates by estimated worst P95, each candidate is simulated whole, and the top K "
                    "by simulated SLO attainment are printed (and written as JSON with --json).")
    add_flags(p, ("profile",), required=("profile",))
    add_flags(p, ("trace", "gpus"), required=("trace", "gpus"))
    p.add_argument("--top", type=int, default=3, metavar="K", help="deployments to return (default 3)")
    add_flags(p, ("json",))  # the plan
    p.add_argument("--ttft-slo", type=float, metavar="S",
                   help="TTFT threshold, seconds (default: 3 x P90 standalone prefill; docs/planner.md)")
    p.add_argument("--itl-slo", type=float, metavar="S",
                   help="mean ITL threshold, seconds (default: 3 x a batch-32 decode step; docs/planner.md)")
    add_flags(p, ("policy",))  # the candidates are simulated with it
    p.add_argument("--no-colocated", action="store_true",
                   help="leave co-located deployments (no prefill workers) out of the search")
    p.add_argument("--one-degree", action="store_true",
                   help="one TP degree per phase (like the paper's Table 2), not mixes such as tp4*1,tp2*2")
    p.add_argument("--all-gpus", action="store_true",
                   help="only deployments that use exactly N GPUs (by default fewer may win on a tie-break)")
    p.add_argument("--candidates", type=int, default=0, metavar="C",
                   help="ILP finalists to check by simulation (default --top + 1)")
    p.add_argument("--check-sessions", type=int, default=None, metavar="M",
                   help="simulate only the first M sessions of the trace in each check (default 250; 0: all)")
    add_flags(p, ("seed",))
    p.add_argument("--estimates-cache", metavar="F",
                   help="keep the check simulations in this file: a later plan of the same trace, profile, "
                        "SLO and policy (any GPU count or top K) reuses them")
    p.set_defaults(func=run)


def load_inputs(profile_arg: str, trace_arg: str):
    """(profile, sessions) or CliError naming the flag."""
    from ampd.perf import load_profile
    from ampd.workload import TraceError, load_trace

    try:
        profile = load_profile(profile_arg)
    except ValueError as exc:
        raise CliError(f"--profile: {exc}") from None
    try:
        sessions = load_trace(trace_arg)
    except TraceError as exc:
        raise CliError(f"--trace: {exc}") from None
    except OSError as exc:
        raise CliError(f"--trace: {trace_arg}: cannot read trace: {exc.strerror or exc}") from None
    if not sessions:
        raise CliError(f"--trace: {trace_arg}: the trace has no sessions")
    return profile, sessions


class _StderrProgress:
    """One updating line on stderr per stage (only on a terminal: logs stay clean)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = ""

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.last and self.last:
            sys.stderr.write("\n" if self.tty else "")
        self.last = stage
        msg = f"plan: {stage} {done}/{total} ({time.monotonic() - self.t0:.1f} s)"
        if self.tty:
            sys.stderr.write("\r" + msg)
        elif done == total:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


def format_plan(out: dict) -> str:
    lines = [f"plan for {out['gpus']} GPUs in {out['seconds']:.2f} s (TTFT SLO {out['slo']['ttft_s']:g} s, "
             f"ITL SLO {out['slo']['itl_s']:g} s; {out['candidates_checked']} candidates simulated)",
             f"{'#':>2}  {'prefill':<16} {'decode':<16} {'SLO att.':>8} {'P95 TTFT':>9} {'est. P95/SLO':>12}"]
    for i, e in enumerate(out["top"], 1):
        p95 = "-" if e["p95_s"] is None else f"{e['p95_s']:.3f}"
        lines.append(f"{i:>2}  {e['prefill']:<16} {e['decode']:<16} {e['slo_attainment'] * 100:>7.1f}% "
                     f"{p95:>9} {e['estimate']['worst_p95_over_slo']:>12.3f}")
    if out["top"] and out["top"][0]["slo_attainment"] == 0:
        lines.append(f"note: no session meets the SLO on any deployment checked (--ttft-slo {out['slo']['ttft_s']:g} s, "
                     f"--itl-slo {out['slo']['itl_s']:g} s): loosen the SLO or plan for more --gpus")
    t = out["timings"]
    lines.append(f"SCIP: {out['solver_calls']} solves in {t['solve_s']:.3f} s; estimates {t['estimates_s']:.3f} s; "
                 f"{t['simulations']} check simulations in {t['simulations_s']:.3f} s")
    return "\n".join(lines)


def _load_cache(path: str | None):
    from .estimates import EstimateCache

    if not path or not os.path.exists(path):
        return EstimateCache()
    try:
        with open(path, encoding="utf-8") as f:
            return EstimateCache.from_json(json.load(f))
    except (OSError, ValueError) as exc:
        raise CliError(f"--estimates-cache: {path}: {exc}") from None


def _save_cache(path: str | None, cache) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cache.to_json(), f)
        os.replace(tmp, path)


def _prefetch_solver() -> None:
    """Import pyscipopt (and the numpy it brings, a fifth of a cold run) on a thread while the trace
    is read and the estimates are made: part of it overlaps (benchmarks/results/planner_time.json).

    pyscipopt stays the solver's interface (its import is ~0.1 s of CPU, most of it numpy, against
    ~0.4 s for a cold 8-GPU plan: measured with ``python -X importtime -c "import pyscipopt"``, not
    enough to justify calling SCIP's C library directly). The planner does no linear algebra, so
    numpy's OpenBLAS gets one thread: starting its pool of one thread per core cost a third of the
    import's CPU time (0.15-0.18 s against 0.09-0.12 s of CPU on 2 cores), unless the user set it."""
    import threading

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    def load() -> None:
        try:
            import pyscipopt  # noqa: F401
        except ImportError:  # the solve itself reports it
            pass
    threading.Thread(target=load, name="import-pyscipopt", daemon=True).start()


def run(args) -> int:
    _prefetch_solver()
    from .plan import CHECK_SESSIONS, PlanRequest, plan, resolve_slo
    from .space import PlanError

    profile, sessions = load_inputs(args.profile, args.trace)
    cache = _load_cache(args.estimates_cache) if args.estimates_cache else None
    t0 = time.monotonic()
    progress = _StderrProgress()
    try:
        slo = resolve_slo(profile, sessions, args.gpus, args.ttft_slo, args.itl_slo)
        req = PlanRequest(profile, sessions, args.gpus, slo, top=args.top, policy=args.policy,
                          colocated=not args.no_colocated, mixed=not args.one_degree, all_gpus=args.all_gpus,
                          candidates=args.candidates, check_sessions=CHECK_SESSIONS if args.check_sessions is None else args.check_sessions, seed=args.seed)
        result = plan(req, cache=cache, progress=progress)
    except PlanError as exc:
        raise CliError(f"--{exc.field.replace('_', '-')}: {str(exc).partition(': ')[2]}") from None
    finally:
        progress.close()
    out = result.to_json(time.monotonic() - t0)
    out["profile"] = profile.name
    if cache is not None:
        out["timings"]["cached_simulations"] = cache.hits
        _save_cache(args.estimates_cache, cache)
    print(format_plan(out))
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0
