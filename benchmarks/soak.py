"""Soak: many sessions through one live deployment, to see that nothing grows and nothing is lost.

A local deployment (`ampd up` as a library: Redis, coordinator, prefill and decode workers with
their sidecars, mock engines) on the ``zero@none`` profile (every modelled cost zero, so the run
measures the services themselves, not sleeps) replays short multi-round sessions (server-side
tools) in batches. Each service's resident memory (VmRSS) is read after a warm-up batch and after
the last batch; the run passes when every service ends within ``--rss-tolerance`` (10 %) of its
warm-up value and every session completed.

    python -m benchmarks.soak                      # 10,000 sessions, results/soak.json
    python -m benchmarks.soak --sessions 2000 --out /tmp/soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload.trace import Round, Session

RESULTS = Path(__file__).parent / "results"


def sessions(first: int, n: int, rate: float) -> list[Session]:
    """``n`` short sessions (two rounds around a server-side tool) arriving at ``rate`` per second."""
    out = []
    for k in range(n):
        i = first + k
        out.append(Session(f"soak-{i}", k / rate, (
            Round(64 + 32 * (i % 4), 4 + i % 3, 0.0),
            Round(16 + 8 * (i % 3), 3 + i % 2),
        )))
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def rss_all(dep: Deployment) -> dict[str, int]:
    return {c.name: rss_kib(c.proc.pid) for c in dep.children}


def run(n: int, warmup: int, batch: int, rate: float, tolerance: float) -> dict:
    opts = Options(prefill="tp1*1", decode="tp1*2", profile="zero@none", policy="ampd", namespace="soak",
                   ttft_slo=2.0, itl_slo=0.1)
    done = failed = 0
    errors: list[str] = []
    t0 = time.monotonic()
    with Deployment(opts) as dep:
        def go(first: int, count: int) -> None:
            nonlocal done, failed
            records, _, wall, _ = asyncio.run(replay(dep.coordinator, sessions(first, count, rate),
                                                     progress=False, timeout_s=300))
            ok = sum(r.completed for r in records)
            done += ok
            failed += len(records) - ok
            errors.extend(r.error for r in records if not r.completed)
            print(f"soak: {first + count}/{n} sessions, {ok}/{len(records)} completed in {wall:.1f} s; "
                  f"rss KiB {rss_all(dep)}", file=sys.stderr, flush=True)

        go(0, warmup)
        warm = rss_all(dep)
        sent = warmup
        while sent < n:
            count = min(batch, n - sent)
            go(sent, count)
            sent += count
        end = rss_all(dep)
        restarts = list(dep.events)
    growth = {name: (end[name] - warm[name]) / warm[name] for name in warm if warm[name]}
    return {
        "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]),
        "profile": "zero@none", "deployment": "prefill tp1*1, decode tp1*2, policy ampd, mock engines",
        "sessions": n, "warmup_sessions": warmup, "rate_per_s": rate,
        "completed": done, "failed": failed, "errors": errors[:10],
        "rss_kib_after_warmup": warm, "rss_kib_end": end,
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "rss_tolerance": tolerance,
        "supervisor_events": restarts,
        "wall_s": round(time.monotonic() - t0, 1),
        "passed": failed == 0 and done == n and all(abs(g) <= tolerance for g in growth.values()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=1_000, help="sessions before the first RSS reading")
    p.add_argument("--batch", type=int, default=1_000, help="sessions per replay after the warm-up")
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second within a batch")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    a = p.parse_args()
    result = run(a.sessions, a.warmup, a.batch, a.rate, a.rss_tolerance)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("completed", "failed", "rss_growth", "passed", "wall_s")}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
