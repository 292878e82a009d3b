"""SLO attainment of every policy on a live mock deployment, one dureader trace.

For each policy a fresh `Deployment` (Redis, coordinator, 2 prefill + 2 decode workers of the mock
engine timed by a shipped H20 profile; the co-located policies turn the prefill GPUs into co-located
workers, so they run 4 workers) replays the same seeded dureader trace with `replay()`, and
`build_report()` judges it. Policies run one after another, never in parallel.

Writes benchmarks/results/live_policies.json (settings, command, every report, the route reasons the
coordinator logged) and benchmarks/results/live_policies.md (the table).

    python -m benchmarks.live_policies --rate 0.6 --duration 60
    make bench BENCH=live_policies          # the defaults below
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

from ampd.bench.client import replay
from ampd.bench.report import SLO, build_report
from ampd.config import add_flags
from ampd.launcher import Deployment, Options
from ampd.perf import load_profile
from ampd.policy import policy_spec
from ampd.workload import generate

RESULTS = Path(__file__).parent / "results"
DEFAULT_POLICIES = ("ampd", "remote", "local", "colocated")
_REASON = re.compile(r"\broute\b.*?\blocal=(True|False)\b.*?\breason=([A-Za-z0-9_-]+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.live_policies", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dureader")
    p.add_argument("--rate", type=float, default=0.6, help="sessions per second (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="arrival window of the trace, seconds")
    p.add_argument("--seed", type=int, default=7, help="trace seed")
    add_flags(p, ("profile", "tp", "ttft_slo", "itl_slo"))
    p.set_defaults(tp=2, ttft_slo=4.0, itl_slo=0.03)  # this benchmark's: TP 2 workers, its SLOs
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated; also ampd-noreorder, threshold, continuum")
    p.add_argument("--router-seed", type=int, default=0, help="seed of the adaptive router")
    p.add_argument("--timeout", type=float, default=600.0, help="per-session timeout, seconds")
    p.add_argument("--out", default=str(RESULTS / "live_policies.json"))
    p.add_argument("--md", default=str(RESULTS / "live_policies.md"))
    p.add_argument("--append", action="store_true",
                   help="add this run to the runs already in --out (e.g. a second rate) instead of replacing them")
    return p.parse_args(argv)


def route_reasons(run_dir: Path) -> dict[str, int]:
    """Count of `reason (local|remote)` over the coordinator's route log lines."""
    log = run_dir / "coordinator.log"
    counts: Counter[str] = Counter()
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            m = _REASON.search(line)
            if m:
                counts[f"{m.group(2)} ({'local' if m.group(1) == 'True' else 'remote'})"] += 1
    return dict(sorted(counts.items()))


def run_policy(policy: str, sessions, a: argparse.Namespace, slo: SLO) -> dict:
    spec = f"tp{a.tp}*{a.prefill}" if a.prefill > 0 else "none"
    opts = Options(prefill=spec, decode=f"tp{a.tp}*{a.decode}", profile=a.profile, policy=policy,
                   engine="mock", ttft_slo=slo.ttft_s, itl_slo=slo.itl_s, seed=a.router_seed)
    t0 = time.monotonic()
    with Deployment(opts) as dep:
        started = time.monotonic() - t0
        print(f"[{policy}] {dep.describe()} (started in {started:.1f} s)", file=sys.stderr, flush=True)
        records, stats, wall, labels = asyncio.run(replay(dep.coordinator, sessions, progress=False,
                                                          timeout_s=a.timeout))
        shape = {"prefill_tps": dep.prefill_tps, "decode_tps": dep.decode_tps}
        run_dir = dep.run_dir
    report = build_report(policy, records, slo, wall)
    report["wall_s"] = wall
    report["deployment"] = shape
    report["labels"] = labels
    report["route_reasons"] = route_reasons(run_dir)
    report["run_dir"] = str(run_dir)
    report["client_errors"] = stats.errors[:10]
    return report


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def markdown(doc: dict) -> str:
    lines = ["# Live policies: SLO attainment on a mock deployment", ""]
    for i, out in enumerate(doc["runs"]):
        lines += [f"## Run {i + 1}: rate {out['settings']['rate']} sessions/s", ""]
        lines += _run_markdown(out)
    return "\n".join(lines)


def _run_markdown(out: dict) -> list[str]:
    s = out["settings"]
    lines = [
        f"Trace: `{s['preset']}` preset, rate {s['rate']} sessions/s over {s['duration_s']:.0f} s, seed {s['seed']}"
        f" ({s['trace_sessions']} sessions, {s['trace_rounds']} rounds). Profile `{s['profile']}`, TP {s['tp']},"
        f" {s['prefill']} prefill + {s['decode']} decode workers (co-located policies: "
        f"{s['prefill'] + s['decode']} co-located workers). SLO: TTFT <= {s['ttft_slo_s']} s every round,"
        f" session mean ITL <= {s['itl_slo_s'] * 1e3:.0f} ms.",
        "",
        f"Command: `{out['command']}`",
        "",
        "| policy | workers (P / D) | SLO attainment | TTFT ok | ITL ok | TTFT p50 (ms) | TTFT p99 (ms) |"
        " ITL p50 (ms) | ITL p99 (ms) | local fraction | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["reports"]:
        lf = r["local_fraction"]
        d = r["deployment"]
        lines.append(
            f"| {r['policy']} | {len(d['prefill_tps'])} / {len(d['decode_tps'])} | {r['slo_attainment']:.1%} |"
            f" {r['ttft_attainment']:.1%} | {r['itl_attainment']:.1%} |"
            f" {_ms(r['ttft_s']['p50'])} | {_ms(r['ttft_s']['p99'])} | {_ms(r['itl_s']['p50'])} |"
            f" {_ms(r['itl_s']['p99'])} | {'-' if lf is None else f'{lf:.3f}'} | {r['failed']} |")
    lines += ["", "Route reasons (coordinator log, per prefill task):", ""]
    for r in out["reports"]:
        rr = ", ".join(f"{k}: {v}" for k, v in r["route_reasons"].items()) or "-"
        lines.append(f"- {r['policy']}: {rr}")
    lines.append("")
    return lines


def _load_runs(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if "runs" in doc:
        return list(doc["runs"])
    return [doc] if "reports" in doc else []  # an older single-run file


def main(argv: list[str] | None = None) -> dict:
    # `make bench BENCH=live_policies` calls main() without arguments: the defaults apply.
    a = parse_args([] if argv is None else argv)
    slo = SLO(a.ttft_slo, a.itl_slo)
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    for pol in policies:
        policy_spec(pol)  # ValueError listing the valid names
    prof = load_profile(a.profile)
    sessions = generate(a.preset, a.rate, a.duration, a.seed)
    first = [s.rounds[0].input for s in sessions]
    typical = sorted(first)[len(first) // 2] if first else 0
    settings = {
        "preset": a.preset, "rate": a.rate, "duration_s": a.duration, "seed": a.seed,
        "trace_sessions": len(sessions), "trace_rounds": sum(len(s.rounds) for s in sessions),
        "profile": a.profile, "tp": a.tp, "prefill": a.prefill, "decode": a.decode, "engine": "mock",
        "ttft_slo_s": a.ttft_slo, "itl_slo_s": a.itl_slo, "router_seed": a.router_seed,
        "policies": policies,
        # What the SLOs are relative to (the mock's costs come from the profile):
        "median_initial_prompt_tokens": typical,
        "t_pre_median_initial_s": prof.t_pre(a.tp, 0, typical),
        "t_dec_batch4_ctx5k_s": prof.t_dec(a.tp, 4, 4 * 5000),
        "t_dec_batch8_ctx5k_s": prof.t_dec(a.tp, 8, 8 * 5000),
    }
    argv_str = " ".join(shlex.quote(x) for x in (argv or []))
    out = {"command": f"python -m benchmarks.live_policies {argv_str}".strip(),
           "machine": f"{platform.machine()} {platform.python_version()}",
           "when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": settings, "reports": []}
    RESULTS.mkdir(exist_ok=True)
    earlier = _load_runs(Path(a.out)) if a.append else []
    print(f"{len(sessions)} {a.preset} sessions at {a.rate}/s over {a.duration:.0f} s; policies {policies}",
          file=sys.stderr, flush=True)
    for pol in policies:
        rep = run_policy(pol, sessions, a, slo)
        out["reports"].append(rep)
        lf = rep["local_fraction"]
        print(f"[{pol}] attainment {rep['slo_attainment']:.3f} (ttft {rep['ttft_attainment']:.3f}, itl "
              f"{rep['itl_attainment']:.3f}) local_fraction {lf} failed {rep['failed']} "
              f"reasons {rep['route_reasons']} wall {rep['wall_s']:.1f} s", file=sys.stderr, flush=True)
        # Write after every policy so a partial run still leaves its results.
        doc = {"runs": [*earlier, out]}
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
        Path(a.md).write_text(markdown(doc))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
