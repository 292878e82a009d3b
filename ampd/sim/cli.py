"""`ampd simulate`: replay a trace on a simulated deployment (virtual clock, same policy cores)."""
from __future__ import annotations

import json
import os

from ampd import compiled
from ampd.cli import CliError
from ampd.config import SIMULATE_SETTINGS, add_flags, inherited


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay a trace on a simulated deployment and report SLO attainment",
        description="Discrete-event simulation of a whole deployment on a virtual clock, running the "
                    "same routing/queue policies and performance model as the live services. "
                    "Prints the report of `ampd bench` (same keys, same code). A co-located policy "
                    "(colocated, continuum) runs no prefill workers: the --prefill GPUs become "
                    "co-located workers, as in `ampd up`.")
    add_flags(p, SIMULATE_SETTINGS, required=("trace", "profile", "decode", "policy", "ttft_slo", "itl_slo"))
    p.set_defaults(func=run)


def run(args) -> int:
    from ampd.bench.report import format_report
    from ampd.deployment import format_spec, worker_shape
    from ampd.perf import load_profile
    from ampd.slo import SLO
    from ampd.workload import TraceError, load_trace

    from .gcpause import gc_paused

    from .config import PathLatency, SimConfig
    from .loop import Simulator
    from .records import sim_report

    try:
        path = PathLatency.parse(args.path_latency)
    except ValueError as exc:
        raise CliError(f"--path-latency: {exc}") from None
    try:
        profile = load_profile(args.profile)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        shape = worker_shape(args.policy, args.prefill, args.decode, profile.tps, auto_prefill=None)
    except ValueError as exc:  # a bad SPEC or an unknown policy
        raise CliError(str(exc).replace("is not in the profile", f"is not in profile {profile.name}")) from None
    try:
        with gc_paused():  # ~1M rounds at paper scale: see gc_paused
            sessions = load_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"{args.trace}: cannot read trace: {exc.strerror or exc}") from None
    if not sessions:
        raise CliError(f"{args.trace}: the trace has no sessions")
    router = {"slack": args.slack or None, "alpha": args.alpha, "beta": args.beta,
              "threshold_tokens": args.threshold_tokens}
    settings = {**inherited(args, SimConfig), "decode": shape.decode}  # the SPECs resolved
    cfg = SimConfig(profile=profile, policy=args.policy, prefill=shape.prefill, router_options=router, path=path,
                    **settings)
    try:
        sim = Simulator(cfg)
        res = sim.run(sessions)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    report = sim_report(res, SLO(args.ttft_slo, args.itl_slo))
    report["deployment"] = {"prefill": format_spec(shape.prefill), "decode": format_spec(shape.decode),
                            "gpus": res.stats["gpus"], "profile": profile.name,
                            "kv_contention": bool(args.kv_contention), "seed": args.seed,
                            "window_s": args.stats_window, "path_latency": path.format()}
    report["simulation"]["cores"] = compiled.STATE  # compiled, or why the Python sources ran
    print(format_report(report))
    st = res.stats
    print(f"simulated {len(sessions)} sessions on {format_spec(shape.prefill)} + {format_spec(shape.decode)} "
          f"({st['gpus']} GPUs): {st['sim_end_s']:.1f} s virtual in {st['wall_s']:.2f} s wall, "
          f"{st['events']} events, on the {'compiled cores' if compiled.active() else 'Python sources'}")
    if args.json:
        text = json.dumps(report, indent=2, sort_keys=False)
        if args.json == "-":
            print(text)
        else:
            d = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(d, exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0
