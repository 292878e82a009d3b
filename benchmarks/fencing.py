"""Issue 24's finding 4 at its own scale: a worker stopped (SIGSTOP) mid-replay, then continued.

    python -m benchmarks.fencing [--json benchmarks/results/fencing.json] [--stop-s 20]

`ampd up --prefill 1 --decode 2 --engine mock` (default policy and --fence-after), a replay of 40
sessions of three rounds arriving over 10 s; 3 s in, the victim (decode-0, then prefill-0, each on a
fresh deployment) is stopped for ``--stop-s`` seconds, then continued. Reports per victim: sessions
completed and failed (with their statuses), token mismatches, the longest session, the replay's wall
time; the coordinator's fences, moves and re-routed prefills; and, once the resumed worker settled,
its fence count, whether its KV pool is empty, and the session and fence keys left in Redis.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time

import redis

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from ampd.workload.trace import Round, Session
from benchmarks import write_json

NS = "fencing-bench"
SETTLE_S = 25.0  # after the replay: the resumed worker's held blocks go within twice --fence-after


_STUBS = {"decode": decode_pb2_grpc.DecodeWorkerStub, "prefill": prefill_pb2_grpc.PrefillWorkerStub,
          "coordinator": coordinator_pb2_grpc.CoordinatorStub}


async def service_metrics(address: str, kind: str) -> dict[str, float]:
    ch = grpcserver.channel(address)
    try:
        return dict((await _STUBS[kind](ch).Metrics(common_pb2.MetricsRequest(), timeout=10)).values)
    finally:
        await ch.close()


def _trace() -> list[Session]:
    return [Session(f"s{i}", 0.25 * i, (Round(300 + 40 * (i % 5), 20 + i % 5, 0.5), Round(60, 15, 0.5),
                                        Round(40, 10)))
            for i in range(40)]


def one(victim: str, stop_s: float) -> dict:
    with Deployment(Options(prefill="tp1*1", decode="tp1*2", profile="qwen3-32b@h20", namespace=NS,
                            run_dir=tempfile.mkdtemp(prefix="ampd-fencing-"))) as dep:
        pid = dep.child(victim).proc.pid

        async def go():
            async def inject():
                await asyncio.sleep(3.0)
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(stop_s)
                finally:
                    os.kill(pid, signal.SIGCONT)

            task = asyncio.create_task(inject())
            try:
                return await replay(dep.coordinator, _trace(), verify_tokens=True, progress=False, timeout_s=180)
            finally:
                await task

        records, stats, wall, _ = asyncio.run(go())
        time.sleep(SETTLE_S)
        r = redis.Redis.from_url(dep.redis_url)
        raw = r.hget(f"{NS}:workers", victim)
        m = asyncio.run(service_metrics(json.loads(raw)["address"], json.loads(raw)["kind"])) if raw else {}
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        longest = max(stats.ended_at[x.session_id] - stats.started_at[x.session_id] for x in records)
        return {
            "victim": victim, "stop_s": stop_s, "sessions": len(records),
            "completed": sum(x.completed for x in records),
            "failed": [x.error for x in records if not x.completed], "token_mismatches": stats.token_mismatches,
            "longest_session_s": round(longest, 1), "wall_s": round(wall, 1),
            "coordinator": {k: coord.get(k, 0.0) for k in ("workers_fenced", "sessions_moved", "prefills_rerouted",
                                                          "sessions_live", "kv_promised_tokens")},
            "victim_registered": raw is not None, "victim_fences": m.get("fences"),
            "victim_kv_empty": bool(m) and m["kv_free_tokens"] == m["kv_capacity_tokens"],
            "session_keys_left": len(r.keys(f"{NS}:session:*")), "fence_keys_left": len(r.keys(f"{NS}:fence:*")),
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/fencing.json")
    ap.add_argument("--stop-s", type=float, default=20.0)
    args = ap.parse_args(argv if argv is not None else [])
    runs = []
    for victim in ("decode-0", "prefill-0"):
        runs.append(one(victim, args.stop_s))
        print(json.dumps(runs[-1]), file=sys.stderr)
    write_json(args.json, {"command": "python -m benchmarks.fencing", "runs": runs})


if __name__ == "__main__":
    main(sys.argv[1:])
