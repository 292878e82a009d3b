"""Shared state without a single point of failure: `ampd up`'s services (2 prefill, 2 decode workers
and the coordinator, mock engines) find Redis through three Sentinels; the master is killed with
SIGKILL mid-replay and never comes back. The replay completes with no session lost and every token
checked at its position; every worker is registered and alive on the promoted replica, and nothing
is left there but the live workers' and the coordinator's keys. (`make test-multihost`)"""
from __future__ import annotations

import asyncio
import time

import pytest

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload.trace import Round, Session
from tests.integration.rpc_metrics import service_metrics
from tests.integration.test_faults import _nothing_left
from tests.sentinels import SentinelSet

pytestmark = pytest.mark.timeout(240)

NS = "sentinel"
WORKERS = {"decode-0", "decode-1", "prefill-0", "prefill-1"}


def _trace(n: int = 24) -> list[Session]:
    """Three-round sessions with server-side tool calls, arriving over ~7 s."""
    return [Session(f"s{i}", 0.3 * i, (Round(300 + 40 * (i % 5), 14 + i % 5, 0.4), Round(60, 10, 0.3), Round(40, 8)))
            for i in range(n)]


def _registered_since(r, t: float) -> set[str]:
    """The workers registered whose liveness key was renewed (a heartbeat) after unix time ``t``."""
    out = set()
    for w in r.hkeys(f"{NS}:workers"):
        alive = r.get(f"{NS}:alive:{w.decode()}")
        if alive is not None and float(alive) > t:
            out.add(w.decode())
    return out


def test_replay_survives_the_redis_master_killed(tmp_path):
    with SentinelSet(tmp_path / "redis") as s:
        opts = Options(prefill="tp1*2", decode="tp1*2", profile="qwen3-32b@h20", policy="remote", namespace=NS,
                       redis_url=s.url, run_dir=str(tmp_path / "run"))
        sessions = _trace()
        with Deployment(opts) as dep:
            killed: dict[str, float | str] = {}

            async def kill_master():
                await asyncio.sleep(3.0)
                killed["at"] = time.time()
                killed["name"] = s.kill_master()

            async def scenario():
                killer = asyncio.create_task(kill_master())
                out = await replay(dep.coordinator, sessions, verify_tokens=True, progress=False, timeout_s=90)
                await killer
                return out

            records, stats, wall, _ = asyncio.run(scenario())
            new = s.wait_failover(str(killed["name"]))
            lost = [x for x in records if not x.completed]
            print(f"\nsentinel failover: {killed['name']} killed at 3 s, {new} promoted; "
                  f"{len(records) - len(lost)}/{len(records)} sessions completed in {wall:.1f} s, "
                  f"{stats.tokens} tokens, {stats.token_mismatches} mismatched")
            assert not lost, [x.error for x in lost]
            assert stats.token_mismatches == 0
            assert stats.tokens == sum(r_.output for x in sessions for r_ in x.rounds)

            r = s.client(new)
            deadline = time.monotonic() + 30
            while _registered_since(r, float(killed["at"])) != WORKERS and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _registered_since(r, float(killed["at"])) == WORKERS
            assert not [e for e in dep.events if "exited" in e], dep.events  # no service died of it
            coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
            assert coord["sessions_live"] == 0
            deadline = time.monotonic() + 30
            while r.keys(f"{NS}:session:*") and time.monotonic() < deadline:
                time.sleep(0.2)
            _nothing_left(r, WORKERS, ns=NS)
