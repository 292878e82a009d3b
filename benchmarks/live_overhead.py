"""What the live path itself adds per round, with a profile whose costs are all zero.

Client -> coordinator -> (route) -> prefill worker -> NIXL read + write-back -> decode worker ->
coordinator -> client, measured at the client from sending a round's input (the session open or
the tool result) to receiving that round's first token. Sessions run one at a time so that the
numbers are the path's latency, not queueing. Writes benchmarks/results/live_overhead.json.
"""
from __future__ import annotations

import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session

RESULTS = Path(__file__).parent / "results"


def sessions(n: int, rounds: int, l_hist_growth: int = 512) -> list[Session]:
    rs = tuple(Round(input=l_hist_growth, output=4, tool_s=0.0) for _ in range(rounds - 1)) + (
        Round(input=l_hist_growth, output=4),)
    return [Session(id=f"lat-{i:04d}", arrival=0.0, rounds=rs) for i in range(n)]


async def measure(address: str, n: int, rounds: int) -> list[float]:
    lat: list[float] = []
    for s in sessions(n, rounds):  # one at a time: latency, not queueing
        _, stats, _, _ = await replay(address, [s], client_tools=True, progress=False)
        assert not stats.errors, stats.errors
        lat.extend(stats.client_latency)
    return lat


def summary(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"samples": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


def main(n: int = 60, rounds: int = 5) -> dict:
    out = {"command": "make bench (benchmarks/live_overhead.py)", "profile": "zero@none",
           "machine": f"{platform.machine()} {platform.python_version()}", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "sessions": n, "rounds_per_session": rounds, "paths": {}}
    for policy in ("remote", "local"):
        opts = Options(prefill="tp1*1", decode="tp1*1", profile="zero@none", policy=policy)
        with Deployment(opts) as dep:
            asyncio.run(measure(dep.coordinator, 3, 2))  # warm NIXL connections and channels
            lat = asyncio.run(measure(dep.coordinator, n, rounds))
        out["paths"][policy] = summary(lat)
        print(f"{policy:>7}: per-round added latency {out['paths'][policy]}", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "live_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
