"""Prefix sharing on a live mock deployment: sessions with a shared system prompt, sharing off against
on (--prefix-sharing; services/decode/prefix.py), in one run.

    python -m benchmarks.prefix_sharing_live [--out benchmarks/results/prefix_sharing_live.json] [--quick]

Trace (seeded): ``SESSIONS`` sessions arriving at ``RATE`` a second (Poisson), each of 2 or 3 rounds;
the first round's prompt is a ``SYSTEM_TOKENS``-token system prompt every session shares (the trace's
hash_ids name its 512-token blocks, so the replayed ids of those blocks are equal) and a user part of
its own (64 to 512 tokens); later rounds are tool results of 40 to 160 tokens after server-side tool
calls of 1 to 3 s; 16 to 48 output tokens a round. Deployment: the mock engine timed by the
qwen3-32b@h20 profile, one prefill and two decode workers (TP 1), policy ampd, TTFT SLO 2 s.

Reports per variant: tokens prefilled (the rounds' l_incr), tokens shared (the decode workers'
``prefix_shared_tokens``), the sessions the coordinator bound for a prefix (moved from admission's
worker to one holding a longer prefix of its prompt: ``bind_prefix``) and the sessions bound to each
decode worker, first-round TTFT P50/P90, SLO attainment, sessions completed, token and KV
byte mismatches, and whether every decode worker's pool was empty at the end (free plus cached prefix
blocks = capacity, no session). The box is shared: compare the variants of one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.bench.report import build_report
from ampd.launcher import Deployment, Options
from ampd.policy import SLO
from ampd.state import StateStore, connect
from ampd.v1 import common_pb2, coordinator_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from ampd.workload import Round, Session
from benchmarks import write_json

SESSIONS, RATE, SEED = 32, 0.5, 11
SYSTEM_TOKENS = 2048  # four 512-token hash blocks
PROFILE = "qwen3-32b@h20"
SLO_ = SLO(ttft_s=2.0, itl_s=0.1)
VARIANTS = {"off": False, "on": True}


def trace(n: int, rate: float, seed: int) -> list[Session]:
    rng = random.Random(seed)
    system = tuple(range(SYSTEM_TOKENS // 512))
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        k = rng.randint(2, 3)
        user = rng.randint(64, 512)
        rounds = [Round(input=SYSTEM_TOKENS + user, output=rng.randint(16, 48), tool_s=rng.uniform(1.0, 3.0),
                        hash_ids=(*system, 1000 + i))]
        rounds += [Round(input=rng.randint(40, 160), output=rng.randint(16, 48),
                         tool_s=rng.uniform(1.0, 3.0) if j < k - 1 else None) for j in range(1, k)]
        out.append(Session(f"s{i:02d}", round(t, 3), tuple(rounds)))
    return out


async def worker_metrics(redis_url: str, namespace: str) -> dict[str, tuple[str, dict[str, float]]]:
    """worker id -> (its kind, its Metrics values)."""
    store = StateStore(await connect(redis_url), namespace)
    stubs = {"decode": decode_pb2_grpc.DecodeWorkerStub, "prefill": prefill_pb2_grpc.PrefillWorkerStub}
    out = {}
    try:
        for wid, info in (await store.workers()).items():
            ch = grpcserver.channel(info.address)
            try:
                reply = await stubs[info.kind](ch).Metrics(common_pb2.MetricsRequest(), timeout=10)
                out[wid] = (info.kind, dict(reply.values))
            finally:
                await ch.close()
    finally:
        await store.r.aclose()
    return out


async def coordinator_metrics(address: str) -> dict[str, float]:
    ch = grpcserver.channel(address)
    try:
        return dict((await coordinator_pb2_grpc.CoordinatorStub(ch).Metrics(common_pb2.MetricsRequest(),
                                                                             timeout=10)).values)
    finally:
        await ch.close()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def one(name: str, on: bool, sessions: list[Session], run_dir: Path) -> dict:
    opts = Options(prefill="tp1*1", decode="tp1*2", profile=PROFILE, policy="ampd", ttft_slo=SLO_.ttft_s,
                   itl_slo=SLO_.itl_s, prefix_sharing=on, namespace=f"prefixlive-{name}", run_dir=str(run_dir / name))
    load0 = os.getloadavg()[0]
    with Deployment(opts) as dep:
        records, stats, wall, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                     timeout_s=180))
        workers = asyncio.run(worker_metrics(dep.redis_url, opts.deployment.namespace))
        coord = asyncio.run(coordinator_metrics(dep.coordinator))
    rep = build_report(name, records, SLO_, wall)
    decode = {w: m for w, (kind, m) in workers.items() if kind == "decode"}
    ttft1 = [r.rounds[0].first_token - r.rounds[0].input_ready for r in records
             if r.rounds and r.rounds[0].first_token is not None]
    empty = all(m["active_sessions"] == 0 and m["kv_free_tokens"] == m["kv_capacity_tokens"] for m in decode.values())
    return {"variant": name, "prefix_sharing": on, "sessions": len(records), "completed": rep["completed"],
            "tokens_prefilled": sum(x.l_incr for r in records for x in r.rounds),
            "tokens_shared": int(sum(m.get("prefix_shared_tokens", 0) for m in decode.values())),
            "sessions_bound_for_prefix": int(coord.get("bind_prefix", 0)),
            "sessions_by_decode_worker": dict(sorted(Counter(stats.bound_to.values()).items())),
            "first_round_ttft_p50_s": _pct(ttft1, 0.5), "first_round_ttft_p90_s": _pct(ttft1, 0.9),
            "first_round_ttft_mean_s": round(statistics.fmean(ttft1), 4) if ttft1 else None,
            "slo_attainment": rep["slo_attainment"], "ttft_p90_s": rep["ttft_s"]["p90"],
            "token_mismatches": stats.token_mismatches,
            "kv_bytes_mismatched": int(sum(m.get("kv_bytes_mismatched", 0) for _, m in workers.values())),
            "kv_bytes_verified": int(sum(m.get("kv_bytes_verified", 0) for _, m in workers.values())),
            "prefix_cached_tokens_end": int(sum(m.get("prefix_cached_tokens", 0) for m in decode.values())),
            "pools_empty": empty, "wall_s": round(wall, 2),
            "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_sharing_live", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/prefix_sharing_live.json")
    p.add_argument("--quick", action="store_true", help=f"{SESSIONS // 4} sessions")
    a = p.parse_args(argv)
    sessions = trace(SESSIONS // 4 if a.quick else SESSIONS, RATE, SEED)
    run_dir = Path(tempfile.mkdtemp(prefix="prefixlive-"))  # the deployments' logs
    print(f"logs: {run_dir}", file=sys.stderr)
    t0 = time.monotonic()
    runs = []
    for name, on in VARIANTS.items():
        r = one(name, on, sessions, run_dir)
        runs.append(r)
        print(r, file=sys.stderr, flush=True)
    doc = {"benchmark": "prefix_sharing_live", "sessions": len(sessions), "rate_per_s": RATE, "seed": SEED,
           "system_prompt_tokens": SYSTEM_TOKENS, "profile": PROFILE, "deployment": "prefill tp1*1, decode tp1*2",
           "slo": {"ttft_s": SLO_.ttft_s, "itl_s": SLO_.itl_s}, "runs": runs,
           "seconds": round(time.monotonic() - t0, 1)}
    write_json(a.out, doc)
    return doc


if __name__ == "__main__":
    main()
