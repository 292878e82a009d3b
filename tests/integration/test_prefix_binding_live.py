"""Binding for a prefix on a live mock deployment (--prefix-sharing; services/coordinator/prefixes.py):
real Redis on a free port, the services on loopback, one prefill and two decode workers. Sessions
whose first prompts start with the same long system prompt (two 512-token hash blocks: 32 KV blocks),
arriving one after another while the earlier ones are still in their tool calls, all bind to the
decode worker that holds it and share it, although admission alone would alternate them; sessions
with prompts of their own still go where admission puts them (the other worker). The decode workers'
published prefix sets are in Redis while they serve and gone once the deployment stopped."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from tests.integration.live_replay import fast_profile
from tests.integration.rpc_metrics import service_metrics

pytestmark = pytest.mark.timeout(120)

SYSTEM = (0, 1)
SHARED = [Session(f"s{i}", 0.8 * i, (Round(input=1024 + 40 + 7 * i, output=6, tool_s=4.0, hash_ids=(*SYSTEM, 100 + i)),
                                     Round(input=30, output=6)))
          for i in range(5)]
OWN = [Session(f"o{i}", 0.4 + 0.8 * i, (Round(input=1024 + 3 * i, output=6, tool_s=4.0,
                                               hash_ids=(200 + 2 * i, 201 + 2 * i, 300 + i)),
                                         Round(input=30, output=6)))
       for i in range(4)]
NS = "prefixbind"


def _profile(tmp_path: Path) -> str:
    return fast_profile(tmp_path, "prefixbind@test")


def test_sessions_bind_to_the_worker_holding_their_system_prompt_and_others_spread(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    opts = Options(prefill="tp1*1", decode="tp1*2", profile=_profile(tmp_path), policy="ampd", prefix_sharing=True,
                   redis_url=redis_url, namespace=NS, run_dir=str(tmp_path / "run"))
    sessions = sorted(SHARED + OWN, key=lambda s: s.arrival)
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                  timeout_s=60))
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        keys = {k.decode(): r.pttl(k) for k in r.scan_iter(match=f"{NS}:prefix:*")}
    assert all(rec.completed for rec in records), [rec.error for rec in records]
    assert stats.token_mismatches == 0 and not stats.errors
    bound = stats.bound_to
    holder = bound["s0"]
    assert {bound[s.id] for s in SHARED} == {holder}, bound
    first = {rec.session_id: rec.rounds[0] for rec in records}
    assert all(first[s.id].l_hist >= 1024 for s in SHARED[1:]), {k: v.l_hist for k, v in first.items()}
    # admission alone would have put every later shared session on the other worker (its promises are
    # smaller: the sessions of their own ask for less KV)
    print(bound, {k: v for k, v in coord.items() if k.startswith("bind_")})
    assert coord.get("bind_prefix", 0) >= 2 and coord["bind_prefix_tokens"] >= 2 * 1024, coord
    assert coord["bind_prefix"] + coord["bind_admission"] == len(sessions)
    assert {bound[s.id] for s in OWN} - {holder}, bound  # prompts of their own: not pulled onto the holder
    assert f"{NS}:prefix:{holder}" in keys and all(ttl > 0 for ttl in keys.values()), keys
    assert not list(r.scan_iter(match=f"{NS}:prefix:*")), "a stopped deployment leaves no prefix set"
