"""The host KV tier on a live mock deployment: a long-tool agent trace on a KV-tight decode worker,
today's deployment against the tier (services/decode/tier.py: every move over NIXL, byte-checked).

    python -m benchmarks.kv_tier_live [--out benchmarks/results/kv_tier_live.json] [--quick]

Trace (seeded): ``SESSIONS`` sessions arriving at ``RATE`` a second (Poisson), each of 3 to 5 rounds
(first input 300 to 700 tokens, later ones 60 to 200, 8 to 24 output tokens) separated by
server-side tool calls of 2 to 6 s through the sidecar: long next to a round, so sessions idle in
tool calls hold most of the KV. Deployment: one prefill and one decode worker of the mock engine,
zero@none with a constant prefill time of ``PRE_S`` and 10 ms decode steps, the decode worker's KV
pool cut to ``KV_TOKENS``. Variants, same trace:

- ``today``: the deployment without the tier (``--kv-host-ratio 0``; the default before the tier
  was measured on): coordinator admission ``kv`` (a session is bound only where its KV is promised; the others wait up to ``--admission-wait`` and are
  refused with ``kv-full``);
- ``admit-all``: admission ``none`` (every session bound at once; its rounds wait for KV), tier off:
  the idle histories hold the pool and the rounds wait for each other (the replay gives up on a
  session after 120 s);
- ``ratio-1``: ``host+kv`` with the host pool sized by ``--kv-host-ratio 1`` (as large as the device
  pool, ``KV_TOKENS``) instead of ``--kv-host-mb``;
- ``host``: admission ``none`` and ``--kv-host-mb HOST_MB``;
- ``host+early``: the same, and offloaded KV starts coming back at the tool's expected end
  (``--kv-prefetch-early``) into blocks no waiting round needs;
- ``host+kv``: the tier under the default admission ``kv``, which promises the decode worker's
  device pool plus as much of the host pool its registration names (``WorkerInfo.kv_host_tokens``)
  as KV idle in tool calls can really occupy (``ampd.policy.offshare``; the device only until four
  tool calls were seen).

Reports per variant: sessions completed, refused and failed, SLO attainment, TTFT P90, end-to-end
P50, the tier's decisions and moves by reason, bytes to and from host, recomputed history tokens,
and the load average while it ran (the box is shared: compare variants of one run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from ampd import grpcserver, perf
from ampd.bench.client import replay
from ampd.bench.report import build_report
from ampd.launcher import Deployment, Options
from ampd.policy import SLO
from ampd.v1 import common_pb2, decode_pb2_grpc
from ampd.workload import Round, Session
from benchmarks import write_json

SESSIONS, RATE, SEED = 24, 1.0, 7
KV_TOKENS = 4096  # the decode worker's pool: about four sessions' histories
HOST_MB = 4  # 64 KiB a 32-token block (64 bytes a token): 65,536 tokens of host pool
PRE_S = 0.05
SLO_ = SLO(ttft_s=2.0, itl_s=0.1)
OFF = {"kv_host_ratio": 0}  # the tier off, whatever the default (ampd/config.py kv_host_ratio)
VARIANTS = {
    "today": OFF,
    "admit-all": {"admission": "none", **OFF},
    "ratio-1": {"kv_host_ratio": 1},
    "host": {"admission": "none", "kv_host_mb": HOST_MB},
    "host+early": {"admission": "none", "kv_host_mb": HOST_MB, "kv_prefetch_early": True},
    "host+kv": {"kv_host_mb": HOST_MB},
}


def trace(n: int, rate: float, seed: int) -> list[Session]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        k = rng.randint(3, 5)
        rounds = tuple(Round(input=rng.randint(300, 700) if j == 0 else rng.randint(60, 200), output=rng.randint(8, 24),
                             tool_s=rng.uniform(2.0, 6.0) if j < k - 1 else None) for j in range(k))
        out.append(Session(f"s{i:02d}", round(t, 3), rounds))
    return out


def profile(run_dir: Path) -> str:
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "kvtierlive@mock"
    t1 = d["tp"]["1"]
    t1["kv_capacity_tokens"] = KV_TOKENS
    t1["t_pre"]["l_incr"]["alpha"] = [PRE_S] * len(t1["t_pre"]["l_incr"]["alpha"])
    t1["t_dec"]["batch"]["alpha"] = [0.01] * len(t1["t_dec"]["batch"]["alpha"])
    path = run_dir / "kvtierlive@mock.json"
    path.write_text(json.dumps(d))
    return str(path)


async def decode_metrics(address: str) -> dict[str, float]:
    ch = grpcserver.channel(address)
    try:
        return dict((await decode_pb2_grpc.DecodeWorkerStub(ch).Metrics(common_pb2.MetricsRequest(), timeout=10)).values)
    finally:
        await ch.close()


def one(name: str, settings: dict, sessions: list[Session], run_dir: Path) -> dict:
    ns = f"kvtierlive-{name}"
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=profile(run_dir), policy="ampd", ttft_slo=SLO_.ttft_s,
                   itl_slo=SLO_.itl_s, namespace=ns, run_dir=str(run_dir / name), **settings)
    load0 = os.getloadavg()[0]
    with Deployment(opts) as dep:
        records, stats, wall, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                     timeout_s=120))
        m = asyncio.run(decode_metrics(f"127.0.0.1:{dep.child('decode-0').port}"))
    rep = build_report(name, records, SLO_, wall)
    refused = sum("RESOURCE_EXHAUSTED" in r.error for r in records)
    tier = {k[len("kv_tier_"):]: v for k, v in sorted(m.items()) if k.startswith("kv_tier_")}
    return {"variant": name, "settings": settings, "sessions": len(records), "completed": rep["completed"],
            "refused": refused, "failed": len(records) - rep["completed"] - refused,
            "token_mismatches": stats.token_mismatches, "slo_attainment": rep["slo_attainment"],
            "ttft_p90_s": rep["ttft_s"]["p90"], "e2e_p50_s": rep["e2e_s"]["p50"], "wall_s": round(wall, 2),
            "kv_waits": m.get("kv_waits", 0), "kv_recomputed_tokens": m.get("kv_recomputed_tokens", 0),
            "kv_overcommits": m.get("kv_overcommits", 0), "tier": tier,
            "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_tier_live", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/kv_tier_live.json")
    p.add_argument("--quick", action="store_true", help=f"{SESSIONS // 2} sessions")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    a = p.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    sessions = trace(SESSIONS // 2 if a.quick else SESSIONS, RATE, SEED)
    run_dir = Path(tempfile.mkdtemp(prefix="kvtierlive-"))  # the deployments' logs
    print(f"logs: {run_dir}", file=sys.stderr)
    t0 = time.monotonic()
    runs = []
    for name in names:
        r = one(name, VARIANTS[name], sessions, run_dir)
        runs.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tier"}), file=sys.stderr, flush=True)
    doc = {"benchmark": "kv_tier_live", "sessions": len(sessions), "rate_per_s": RATE, "seed": SEED,
           "kv_capacity_tokens": KV_TOKENS, "kv_host_mb": HOST_MB, "prefill_s": PRE_S,
           "slo": {"ttft_s": SLO_.ttft_s, "itl_s": SLO_.itl_s}, "runs": runs,
           "seconds": round(time.monotonic() - t0, 1)}
    write_json(a.out, doc)
    return doc


if __name__ == "__main__":
    main()
