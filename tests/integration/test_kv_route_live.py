"""Routing by the KV's location on a live deployment (docs/policies.md "The KV's location"): real
coordinator, prefill worker, decode worker with its host KV tier (--kv-host-mb, every idle session's KV
moved: pressure threshold 0), sidecar and Redis on loopback, the mock engine.

Each session's rounds end in server-side tool calls long enough for the tier to move their KV to
host, so each next round starts with its KV on host: the decode worker fetches it back first and its
prefill_task says where the KV was (kv_state "host"), and the coordinator's route reason says so
(``+kv-host``). Checked: every round whose KV came back from host (a prefetch) was routed with a
``+kv-host`` reason and no other round was, no remote prefill is overdue, every session completes
with every token right, and both KV pools are empty at the end."""
from __future__ import annotations

import asyncio

import pytest

from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from tests.integration.rpc_metrics import service_metrics, worker_metrics
from tests.integration.test_kv_tier_live import _profile

pytestmark = pytest.mark.timeout(120)

KV_TOKENS = 8192  # room for every session at once: the tier moves the KV because the threshold is 0
SESSIONS = [Session(f"s{i}", 0.05 * i, (Round(input=300, output=6, tool_s=0.4), Round(input=100, output=6, tool_s=0.4),
                                        Round(input=50, output=6))) for i in range(4)]


def replay_on_host_tier(redis_url: str, tmp_path, policy: str, namespace: str, sessions=SESSIONS):
    """``sessions`` replayed (tokens checked) on a prefill and a decode worker whose host tier moves
    every idle session's KV: the replay's records and stats, the coordinator's and workers' metrics."""
    from ampd.bench.client import replay

    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy=policy,
                   kv_host_mb=1, kv_offload_pressure=0.0, redis_url=redis_url, namespace=namespace,
                   run_dir=str(tmp_path / "run"))
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                  timeout_s=60))
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        workers = {w: m for w, (_, m) in asyncio.run(worker_metrics(redis_url, namespace)).items()}
    return records, stats, coord, workers


def test_rounds_whose_kv_was_on_host_are_routed_saying_so(redis_url, tmp_path):
    records, stats, coord, workers = replay_on_host_tier(redis_url, tmp_path, "ampd", "kvroute")
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 4 * 3 * 6
    m = workers["decode-0"]
    routes = {k[len("route_"):]: v for k, v in coord.items() if k.startswith("route_") and v
              and not k.startswith("route_redis")}
    on_host = sum(v for k, v in routes.items() if k.endswith("+kv-host"))
    prefetches = sum(v for k, v in m.items() if k.startswith("kv_tier_move_prefetch:"))
    failed = sum(v for k, v in m.items() if k.startswith("kv_tier_failed_"))
    print(f"routes {routes}; prefetches {prefetches:.0f}, failed {failed:.0f}")
    # the rounds after the tool calls (2 a session) had their KV on host, and were routed saying so
    assert prefetches == 8 and failed == 0
    assert on_host == prefetches, routes
    assert not any(k.endswith("+kv-gone") for k in routes), routes
    assert m["prefills_overdue"] == 0 and m["sessions_failed"] == 0 and m["kv_overcommits"] == 0
    # no leak: the device pool and the host pool are empty, no session left
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS and m["active_sessions"] == 0
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_tier_host_copies"] == 0


def test_client_turns_are_routed_ahead_with_the_turn_ends_location(redis_url, tmp_path):
    """Client-side calls: each turn ends with the session's KV moved to host, its TurnEnd says so, and
    the coordinator routes the next turn's first round with it (Route.kv_state "host"): the decode
    worker finds the KV where the route says, fetches it first, and the route holds (no prefill_task
    round trip). (That the client's TurnEnd carries no location: tests/unit/test_kvwhere_live.py.)"""
    from tests.integration.test_kv_tier_live import _three_turns

    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="ampd",
                   kv_host_mb=1, kv_offload_pressure=0.0, redis_url=redis_url, namespace="kvroute-turns",
                   run_dir=str(tmp_path / "run"))
    with Deployment(opts) as dep:
        convs = asyncio.run(_three_turns(dep.coordinator, ["c0", "c1", "c2"]))
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        m = asyncio.run(worker_metrics(redis_url, "kvroute-turns"))["decode-0"][1]
    assert not any(c.error or c.duplicates for c in convs), [c.error for c in convs]
    assert all(len(c.tokens) == 18 for c in convs)
    # each round's own reason (its RoundTiming): the first round's KV was new, the later ones' on host
    for c in convs:
        assert [r.route_reason.endswith("+kv-host") for r in c.rounds] == [False, True, True], c.rounds
    on_host = sum(v for k, v in coord.items() if k.startswith("route_") and k.endswith("+kv-host"))
    prefetches = sum(v for k, v in m.items() if k.startswith("kv_tier_move_prefetch:"))
    print({k: v for k, v in coord.items() if k.startswith(("route_", "prefills_"))}, prefetches)
    # the second and third turns of each session (6 rounds) had their KV on host, and were routed so
    assert prefetches == 6 and on_host == 6
    assert coord["prefills_routed_with_turn"] == 9  # every route sent with a turn held (3 opens + 6)
    assert m["prefills_overdue"] == 0 and m["sessions_failed"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] and m["kv_tier_host_used_blocks"] == 0
    assert m["kv_tier_host_copies"] == 0 and m["active_sessions"] == 0
