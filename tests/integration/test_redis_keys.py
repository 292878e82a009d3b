"""Every Redis key a deployment writes has an owner that deletes it or a TTL (issue 24 item 8): after
a replay through the gRPC session API only the documented long-lived keys are left without a TTL,
and once the deployment has stopped nothing of its namespace is left. (The front's keys are checked
with the front, tests/integration/test_frontend_*.py.)"""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import generate
from tests.integration.live_replay import fast_profile

pytestmark = pytest.mark.timeout(180)

NS = "keys"
# Without a TTL while the deployment runs: the worker registry of the live workers (each worker
# deletes its own entries when it stops; ampd/state/store.py).
LONG_LIVED = {f"{NS}:workers", f"{NS}:nixl", f"{NS}:stats"}


def ttls(r: redis.Redis) -> dict[str, int]:
    """Every key of the namespace -> its TTL in ms (-1: none)."""
    return {k.decode(): r.pttl(k) for k in r.scan_iter(match=f"{NS}:*")}


def test_a_replay_leaves_only_owned_keys_and_a_stopped_deployment_none(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    # The keys do not depend on the engines' timing: the fast mock profile (5 ms decode steps) keeps
    # the replay to about its tool calls' time, where qwen3-32b@h20's decode steps took twice as long.
    opts = Options(prefill="tp1*1", decode="tp1*2", profile=fast_profile(tmp_path, "keys@test"), policy="threshold",
                   threshold_tokens=2000, redis_url=redis_url, namespace=NS, run_dir=str(tmp_path))
    sessions = generate("toolbench", rate=8.0, duration=30.0, seed=3)[:12]
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, progress=False, timeout_s=120))
        assert all(rec.completed for rec in records), [rec.error for rec in records if not rec.completed][:3]
        deadline = time.monotonic() + 5  # a session's record goes a moment after its last event
        while any(":session:" in k for k in ttls(r)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = ttls(r)
        assert not [k for k in left if ":session:" in k]
        untimed = {k for k, ttl in left.items() if ttl == -1}
        assert untimed <= LONG_LIVED, sorted(untimed - LONG_LIVED)
        assert any(k.startswith(f"{NS}:alive:") for k in left) and any(k.startswith(f"{NS}:coordinator:") for k in left)
    assert ttls(r) == {}, "a stopped deployment leaves nothing in its namespace"
