"""`ampd bench-sched`: how long scheduling decisions take, including the shared-state read.

Routing: the coordinator's `Cluster` (ampd.state.cluster) over a real Redis holding N prefill and N decode workers with
realistic queues, then `route` (Algorithm 1, every rung down to the cost model). Two modes:
`push` (the default live mode: workers publish, the coordinator follows the channel; the decision
reads no Redis, and the statistics' delivery lag is measured) and `read` (HGETALL per decision).
Reorder: one `pop` of the Algorithm 2 queue at windows 3 and 5. A bare Redis PING is measured in
the same run for scale.
"""
from __future__ import annotations

import asyncio
import math
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ampd.config import DEFAULT_PROFILE as PROFILE  # the profile every tool uses unless told
from ampd.perf import load_profile
from ampd.policy import PrefillTask, make_queue, make_router
from ampd.slo import SLO
from ampd.state import StateStore, WorkerInfo, WorkerStats, connect
from ampd.state.cluster import Cluster, route
from ampd.tasks import BackgroundTasks


def _pct(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1e3
    return round(float(np.percentile(a, 50)), 4), round(float(np.percentile(a, 99)), 4)


def _queue(rng: random.Random, now: float) -> tuple:
    return tuple((f"s{rng.randrange(10**6)}", rng.randrange(3), rng.randrange(0, 8000), rng.randrange(50, 3000),
                  now - rng.random() * 2) for _ in range(rng.randrange(0, 9)))


def _stats(wid: str, rng: random.Random, profile, tp: int, slo: SLO, kind: str) -> WorkerStats:
    now = time.time()
    q = _queue(rng, now)
    # Every window over its slack threshold: each decision walks all three rungs of Algorithm 1.
    window = slo.ttft_s * (1.0 + rng.random()) if kind == "prefill" else slo.itl_s * (1.0 + rng.random())
    return WorkerStats(wid, now, window, q, sum(profile.t_pre(tp, t[2], t[3]) for t in q),
                       rng.randrange(10_000, 400_000), rng.randrange(0, 64))


async def _setup(store: StateStore, n: int, profile, slo: SLO, rng: random.Random) -> list[str]:
    await store.r.flushdb()
    decode_ids = []
    for kind, count in (("prefill", n), ("decode", n)):
        for i in range(count):
            wid = f"{kind}-{i}"
            info = WorkerInfo(wid, kind, f"127.0.0.1:{40000 + i}", 2, f"agent-{wid}", {}, 400_000)
            await store.register_worker(info, b"md", _stats(wid, rng, profile, 2, slo, kind), ttl_s=3600)
            if kind == "decode":
                decode_ids.append(wid)
    return decode_ids


async def _routing(store: StateStore, n: int, mode: str, iters: int) -> dict:
    profile = load_profile(PROFILE)
    slo = SLO(2.0, 0.05)
    rng = random.Random(n)
    decode_ids = await _setup(store, n, profile, slo, rng)
    cluster = Cluster(store, mode, fence_after=math.inf)  # its workers are registrations that never beat
    await cluster.start()
    router = make_router("adaptive", profile, slo, seed=1)
    stop = asyncio.Event()

    async def churn():  # every worker keeps publishing changes while decisions run (~400 updates/s)
        k = 0
        while not stop.is_set():
            kind, i = ("prefill", "decode")[k % 2], (k // 2) % n
            await store.publish_stats(_stats(f"{kind}-{i}", rng, profile, 2, slo, kind))
            k += 1
            await asyncio.sleep(0.0025)

    background = BackgroundTasks()
    background.spawn(churn())
    lat, reasons = [], {}
    for k in range(iters + 200):
        req = PrefillTask(f"r{k}", 1, rng.randrange(0, 8000), rng.randrange(50, 3000), decode_worker=rng.choice(decode_ids))
        t0 = time.perf_counter()
        view = await cluster.view()
        d = route(router, view, req, time.time())
        dt = time.perf_counter() - t0
        if k >= 200:  # warm-up excluded
            lat.append(dt)
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
        await asyncio.sleep(0)  # let the follower ingest updates between decisions
    stop.set()
    await background.close(cancel=False)
    await cluster.stop()
    p50, p99 = _pct(lat)
    out = {"prefill_workers": n, "decode_workers": n, "mode": mode, "p50_ms": p50, "p99_ms": p99,
           "decisions": iters, "reasons": reasons}
    if mode == "push" and cluster.lag_s:
        out["stats_lag_p50_ms"], out["stats_lag_p99_ms"] = _pct(cluster.lag_s)
    return out


def _reorder(window: int, iters: int = 20_000) -> dict:
    profile = load_profile(PROFILE)
    slo = SLO(2.0, 0.05)
    rng = random.Random(window)
    q = make_queue("ttft-aware", profile, slo, 2, window=window)
    now = 1000.0
    for _ in range(16):
        q.push(PrefillTask(f"s{rng.randrange(10**6)}", 1, rng.randrange(0, 8000), rng.randrange(50, 3000),
                          now - rng.random() * 2))
    lat = []
    for _ in range(iters):
        now += 0.01
        t0 = time.perf_counter()
        q.pop(now)
        lat.append(time.perf_counter() - t0)
        q.push(PrefillTask(f"s{rng.randrange(10**6)}", 1, rng.randrange(0, 8000), rng.randrange(50, 3000),
                          now - rng.random() * 2))
    p50, p99 = _pct(lat)
    return {"window": window, "p50_ms": p50, "p99_ms": p99, "pops": iters}


async def _run(url: str, iters: int) -> dict:
    store = StateStore(await connect(url), "benchsched")
    ping = []
    for _ in range(2000):
        t0 = time.perf_counter()
        await store.r.ping()
        ping.append(time.perf_counter() - t0)
    routing = []
    for mode in ("push", "read"):
        for n in (8, 32):
            routing.append(await _routing(store, n, mode, iters))
    await store.r.flushdb()
    await store.r.aclose()
    p50, p99 = _pct(ping[200:])
    return {"redis_rtt_p50_ms": p50, "redis_rtt_p99_ms": p99, "routing": routing,
            "reorder": [_reorder(3), _reorder(5)]}


def run(redis_url: str = "", iters: int = 3000) -> dict:
    import uvloop

    from ampd.state.local import start_redis, stop_process

    proc = None
    if not redis_url:
        proc, redis_url = start_redis(Path(tempfile.mkdtemp(prefix="ampd-sched-")))
    try:
        out = uvloop.run(_run(redis_url, iters))
    finally:
        if proc is not None:
            stop_process(proc)
    out["command"] = "ampd bench-sched"
    out["profile"] = PROFILE
    out["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return out


def format_sched(r: dict) -> str:
    lines = [f"redis PING p50 {r['redis_rtt_p50_ms']:.3f} ms",
             "routing (decision incl. shared-state read)   p50 ms    p99 ms   stats lag p50/p99 ms"]
    for x in r["routing"]:
        lag = f"{x['stats_lag_p50_ms']:.3f}/{x['stats_lag_p99_ms']:.3f}" if "stats_lag_p50_ms" in x else "-"
        lines.append(f"  {x['mode']:>4} mode, {x['prefill_workers']:>2} prefill workers   "
                     f"{x['p50_ms']:8.4f}  {x['p99_ms']:8.4f}   {lag}")
    lines.append("reorder (Algorithm 2 pop)                    p50 ms    p99 ms")
    for x in r["reorder"]:
        lines.append(f"  window {x['window']}                             {x['p50_ms']:8.4f}  {x['p99_ms']:8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    r = run()
    print(format_sched(r))
    out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_sched.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0
