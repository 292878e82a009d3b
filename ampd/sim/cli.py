"""`ampd simulate`: replay a trace on a simulated deployment (virtual clock, same policy cores)."""
from __future__ import annotations

import json
import math
import os
import sys

from ampd.cli import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay a trace on a simulated deployment and report SLO attainment",
        description="Discrete-event simulation of a whole deployment on a virtual clock, running the "
                    "same routing/queue policies and performance model as the live services. "
                    "Prints the report of `ampd bench` (same keys, same code).")
    p.add_argument("--trace", required=True, metavar="F", help="session trace (JSON Lines)")
    p.add_argument("--profile", required=True, metavar="P",
                   help="performance profile: shipped name (MODEL@HARDWARE) or a JSON file")
    p.add_argument("--prefill", default="none", metavar="SPEC",
                   help="prefill replica groups tpN*R[,tpN*R...]; empty or 'none' for none "
                        "(co-located policies)")
    p.add_argument("--decode", required=True, metavar="SPEC", help="decode replica groups tpN*R[,...]")
    p.add_argument("--policy", required=True, metavar="NAME", help="routing/queue policy")
    p.add_argument("--ttft-slo", required=True, type=float, metavar="S", help="TTFT threshold, seconds")
    p.add_argument("--itl-slo", required=True, type=float, metavar="S", help="mean ITL threshold, seconds")
    p.add_argument("--json", metavar="OUT", help="write the JSON report here ('-' for stdout)")
    p.add_argument("--seed", type=int, default=0, metavar="K", help="seed of the router's random order")
    p.add_argument("--window", type=float, default=10.0, metavar="S",
                   help="window of the workers' TTFT/ITL statistics, seconds (default 10)")
    p.add_argument("--kv-contention", action="store_true",
                   help="serialize concurrent KV transfers on each worker's NIC (default off)")
    p.add_argument("--reorder-window", type=int, default=3, metavar="W",
                   help="lookahead window w of the TTFT-aware queue (default 3)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="decode workers split local prefills into chunks interleaved with decode steps")
    p.add_argument("--slack", choices=["window", "queue"], default=None,
                   help="Algorithm 1 slack rule (default: the policy's; 'window' is the paper's)")
    p.add_argument("--path-latency", default="none", metavar="NAME=S[,...]",
                   help="what the live control path adds per round, seconds: open (new session), "
                        "dispatch (input ready -> routed and queued), handoff (remote prefill end -> "
                        "first token), tool (per tool call), prefill_busy (each remote prefill holds its "
                        "worker this much longer than modelled); e.g. 'dispatch=0.01,handoff=0.002' "
                        "(default none; docs/simulator.md)")
    p.set_defaults(func=run)


def _positive(name: str, v: float) -> float:
    if not (math.isfinite(v) and v > 0):
        raise CliError(f"{name} must be a number > 0, got {v!r}")
    return v


def run(args) -> int:
    from ampd.bench.report import SLO as ReportSLO
    from ampd.bench.report import format_report
    from ampd.perf import load_profile
    from ampd.policy import POLICIES, policy_spec
    from ampd.workload import TraceError, load_trace

    from .config import PathLatency, SimConfig
    from .loop import Simulator
    from .records import sim_report
    from .spec import SpecError, format_spec, parse_spec

    ttft = _positive("--ttft-slo", args.ttft_slo)
    itl = _positive("--itl-slo", args.itl_slo)
    window = _positive("--window", args.window)
    try:
        path = PathLatency.parse(args.path_latency)
    except ValueError as exc:
        raise CliError(f"--path-latency: {exc}") from None
    if args.reorder_window < 1:
        raise CliError(f"--reorder-window must be >= 1, got {args.reorder_window}")
    try:
        spec = policy_spec(args.policy)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        pre = parse_spec(args.prefill)
    except SpecError as exc:
        raise CliError(f"--prefill: {exc}") from None
    try:
        dec = parse_spec(args.decode)
    except SpecError as exc:
        raise CliError(f"--decode: {exc}") from None
    if not dec:
        raise CliError("--decode: the deployment needs at least one decode worker")
    if pre and not spec.uses_prefill_workers:
        raise CliError(f"--prefill: policy {args.policy!r} is co-located and runs no prefill workers; "
                       f"pass --prefill none and give all GPUs to --decode")
    try:
        profile = load_profile(args.profile)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for flag, groups in (("--prefill", pre), ("--decode", dec)):
        for tp, _ in groups:
            if tp not in profile.tps:
                raise CliError(f"{flag}: TP {tp} is not in profile {profile.name} "
                               f"(it covers {', '.join(map(str, profile.tps))})")
    try:
        sessions = load_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"{args.trace}: cannot read trace: {exc.strerror or exc}") from None
    if not sessions:
        raise CliError(f"{args.trace}: the trace has no sessions")
    cfg = SimConfig(profile=profile, policy=args.policy, prefill=pre, decode=dec, ttft_slo_s=ttft,
                    itl_slo_s=itl, seed=args.seed, window_s=window, kv_contention=args.kv_contention,
                    reorder_window=args.reorder_window, chunked_prefill=args.chunked_prefill,
                    router_options={"slack": args.slack} if args.slack else {}, path=path)
    try:
        sim = Simulator(cfg)
        res = sim.run(sessions)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    report = sim_report(res, ReportSLO(ttft, itl))
    report["deployment"] = {"prefill": format_spec(pre), "decode": format_spec(dec),
                            "gpus": res.stats["gpus"], "profile": profile.name,
                            "kv_contention": bool(args.kv_contention), "seed": args.seed,
                            "window_s": window, "path_latency": path.format()}
    print(format_report(report))
    st = res.stats
    print(f"simulated {len(sessions)} sessions on {format_spec(pre)} + {format_spec(dec)} "
          f"({st['gpus']} GPUs): {st['sim_end_s']:.1f} s virtual in {st['wall_s']:.2f} s wall, "
          f"{st['events']} events")
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
