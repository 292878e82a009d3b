"""The live path's KV location (services/decode/kvwhere.py on the decode worker, SessionRoutes on
the coordinator): the decode worker reads where a session's KV is from its core's tier state and its
prefetches in flight, takes it once as a round starts, puts it on the round's PrefillTask and the
turn's TurnEnd, and holds a Route only for the location it was decided for; the coordinator routes
the next turn with a TurnEnd's location once and strips it from the TurnEnd."""
from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace as NS

import pytest

from ampd.policy import RouteDecision
from ampd.policy.hostpool import HostBlocks
from ampd.policy.kvwhere import RESIDENT, KVWhere
from ampd.policy.types import KV_GONE, KV_HOST, KV_RESIDENT
from ampd.v1 import common_pb2, decode_pb2
from ampd.worker import DecodeSession
from services.coordinator import routing
from services.coordinator.routing import SessionRoutes
from services.decode import kvwhere


class Cost:
    def t_pre(self, tp, l_hist, l_incr):
        return 0.001 * l_incr

    def t_kv(self, tokens, src_tp, dst_tp):
        return 0.001 * tokens  # 1 ms a token


def worker(tier: bool = True, fetch_began: dict | None = None):
    host = HostBlocks(64, 16)
    core = NS(cost=Cost(), tp=1, tier=NS(host=host) if tier else None)
    return NS(core=core, tier=NS(fetch_began=fetch_began or {}) if tier else None)


def session(sid: str = "s1", rnd: int = 2, fetch: int = 0, recompute: int = 0):
    c = DecodeSession(sid)
    c.round, c.fetch = rnd, fetch
    return NS(session_id=sid, core=c, round=rnd, recompute=recompute, where=None, timing=None, route=None,
              l_hist=0, l_incr=0, tokens=[1] * 500)


def test_without_a_tier_the_kv_is_resident():
    w, s = worker(tier=False), session()
    assert kvwhere.now_where(w, s, 0.0) == RESIDENT
    assert kvwhere.turn_end(w, s, "tool_calls").kv_state == ""


def test_kv_on_host_counts_its_whole_fetch_and_a_prefetch_in_flight_what_is_left():
    w = worker()
    w.core.tier.host.offload_begin("s1", 300)
    w.core.tier.host.offload_done("s1")
    s = session(fetch=300)
    assert kvwhere.now_where(w, s, 5.0) == KVWhere(KV_HOST, pytest.approx(0.3))
    # admitted: the core counts it resident and the live tier's prefetch runs (began at 5.0)
    s.core.fetch = 0
    w.core.tier.host.prefetch_begin("s1")
    w.core.tier.host.prefetch_done("s1")
    w.tier.fetch_began["s1"] = (5.0, 300)
    got = kvwhere.now_where(w, s, 5.1)
    assert got.state == KV_HOST and got.fetch_s == pytest.approx(0.2)


def test_a_round_whose_history_is_prefilled_again_is_gone():
    w, s = worker(), session(recompute=200)
    assert kvwhere.now_where(w, s, 0.0) == KVWhere(KV_GONE, 0.0)


def test_the_location_is_taken_once_per_round_before_the_fetch():
    w, s = worker(fetch_began={"s1": (1.0, 400)}), session()
    kvwhere.note(w, s)
    first = s.where
    assert first[0] == 2 and first[1].state == KV_HOST
    w.tier.fetch_began.clear()  # the fetch ended; the round starts after it: the first look stays
    kvwhere.note(w, s)
    assert s.where is first
    assert kvwhere.task_fields(s, 2) == {"kv_state": KV_HOST, "kv_fetch_s": first[1].fetch_s}
    assert kvwhere.task_fields(s, 3) == {}  # another round: nothing taken, resident
    s.timing = common_pb2.RoundTiming(round=3, kv_recomputed_tokens=100)
    assert kvwhere.round_where(s, 3) == KVWhere(KV_GONE, 0.0)
    task = common_pb2.PrefillTask(session_id="s1", round=2, **kvwhere.task_fields(s, 2))
    assert task.kv_state == KV_HOST and task.kv_fetch_s == pytest.approx(first[1].fetch_s)


def test_the_turn_end_says_where_the_tier_left_the_kv():
    w = worker()
    w.core.tier.host.offload_begin("s1", 300)
    w.core.tier.host.offload_done("s1")
    te = kvwhere.turn_end(w, session(fetch=300), "tool_calls")
    assert (te.kv_state, te.kv_fetch_s, te.finish_reason, te.history_tokens) == (KV_HOST, pytest.approx(0.3),
                                                                                  "tool_calls", 500)


@pytest.mark.parametrize("route_state, where, holds", [
    ("", RESIDENT, True), ("resident", RESIDENT, True), ("host", KVWhere(KV_HOST, 0.2), True),
    ("", KVWhere(KV_HOST, 0.2), False),  # decided for resident KV that was on host: costed without the fetch
    ("host", RESIDENT, False), ("attic", RESIDENT, False)])
def test_a_route_holds_only_for_the_location_it_was_decided_for(route_state, where, holds):
    s = session()
    s.l_hist, s.l_incr, s.where = 100, 20, (2, where)
    s.route = decode_pb2.Route(l_hist=100, l_incr=20, kv_state=route_state)
    assert kvwhere.route_holds(s) is holds
    s.route = decode_pb2.Route(l_hist=90, l_incr=20, kv_state=route_state)
    assert not kvwhere.route_holds(s)


# ------------------------------------------------------------------------------- the coordinator
def routes(decode_id: str = "d0"):
    async def view():
        return NS(read_s=0.0)

    svc = NS(cluster=NS(view=view, routed=lambda *a: None), route_read_ms_total=0.0, router=None,
             remember_remote=lambda *a: None, forget_remote=lambda *a: None)
    run = NS(svc=svc, sid="s1", decode_id=decode_id, info=NS(tp=1))
    return SessionRoutes(run)


@pytest.fixture
def decided(monkeypatch):
    seen: list = []

    def route(router, view, req, now):
        seen.append(req)
        return RouteDecision("d0", True, "cost-model" + ("" if req.kv_state == KV_RESIDENT else f"+kv-{req.kv_state}"),
                             {})
    monkeypatch.setattr(routing, "route", route)
    return seen


def test_the_coordinator_routes_the_next_turn_with_the_turn_ends_location_once(decided):
    r = routes()
    te = common_pb2.TurnEnd(round=1, finish_reason="tool_calls", history_tokens=300, kv_state="host", kv_fetch_s=0.3)
    out = r.heard(te)
    assert (out.kv_state, out.kv_fetch_s) == ("", 0.0)  # stripped: the client never sees it
    assert (out.round, out.finish_reason, out.history_tokens) == (1, "tool_calls", 300)
    route = asyncio.run(r.route_ahead(2, 300, 50))
    assert (decided[-1].kv_state, decided[-1].kv_fetch_s) == (KV_HOST, 0.3) and route.kv_state == KV_HOST
    route = asyncio.run(r.route_ahead(3, 400, 50))  # not reused
    assert (decided[-1].kv_state, decided[-1].kv_fetch_s) == (KV_RESIDENT, 0.0) and route.kv_state == ""


def test_a_gone_kv_is_routed_as_a_full_prefill_and_a_moved_session_forgets_the_location(decided):
    r = routes()
    r.heard(common_pb2.TurnEnd(round=1, kv_state="gone"))
    route = asyncio.run(r.route_ahead(2, 300, 50))
    assert (route.l_hist, route.l_incr, route.kv_state) == (0, 350, KV_GONE)
    r.heard(common_pb2.TurnEnd(round=2, kv_state="host", kv_fetch_s=0.1))
    r.run.decode_id = "d1"  # moved since: the location was the old worker's
    asyncio.run(r.route_ahead(3, 300, 50))
    assert decided[-1].kv_state == KV_RESIDENT


def test_a_bad_location_is_routed_as_resident(decided):
    r = routes()
    out = r.heard(common_pb2.TurnEnd(round=1, kv_state="attic"))
    assert out.kv_state == "" and r.told is None
    need = common_pb2.PrefillTask(session_id="s1", round=2, l_hist=10, l_incr=5, kv_state="host", kv_fetch_s=-1.0)
    posted: list = []
    r.run.control, r.run.secret, r.run.svc.counters = NS(post=posted.append), "", Counter()
    asyncio.run(r.route(need))
    assert decided[-1].kv_state == KV_RESIDENT
    need = common_pb2.PrefillTask(session_id="s1", round=3, l_hist=10, l_incr=5, kv_state="host", kv_fetch_s=0.25)
    asyncio.run(r.route(need))
    assert (decided[-1].kv_state, decided[-1].kv_fetch_s) == (KV_HOST, 0.25)
    assert r.run.svc.counters["route_cost-model+kv-host"] == 1  # the counter ampd_route_decisions_total reads
    assert posted[-1].local_prefill.reason == "cost-model+kv-host"


# -------------------- a round that could not claim its host copy (PrefillTask.kv_fetch_first)
def test_a_round_on_host_that_did_not_claim_its_copy_fetches_first():
    w = worker()
    claims: dict = {}
    w.tier.reads = NS(get=lambda sess: claims.get(sess.session_id))
    w.core.tier.host.offload_begin("s1", 300)
    w.core.tier.host.offload_done("s1")
    s = session(fetch=300)
    s.where = (2, KVWhere(KV_HOST, 0.3))
    assert kvwhere.fetch_first(w, s)  # not claimed: the fetch, then the prefill
    fields = kvwhere.send_fields(w, s, 2, 0.0)
    assert fields == {"kv_state": KV_HOST, "kv_fetch_s": pytest.approx(0.3), "kv_fetch_first": True}
    task = common_pb2.PrefillTask(session_id="s1", round=2, **fields)
    assert task.kv_fetch_first and not task.history_on_host
    claims["s1"] = object()  # claimed: a prefill worker reads the host copy meanwhile
    assert not kvwhere.fetch_first(w, s)
    assert "kv_fetch_first" not in kvwhere.send_fields(w, s, 2, 0.0)
    s.where = (2, RESIDENT)
    del claims["s1"]
    assert not kvwhere.fetch_first(w, s) and kvwhere.send_fields(w, s, 2, 0.0) == {}
    s.where = (2, KVWhere(KV_GONE, 0.0))
    assert not kvwhere.fetch_first(w, s)
    assert kvwhere.send_fields(w, s, 2, 0.0) == {"kv_state": KV_GONE, "kv_fetch_s": 0.0}


def test_a_remote_route_sent_ahead_does_not_hold_for_a_round_that_fetched_first():
    s = session()
    s.l_hist, s.l_incr, s.where = 100, 20, (2, KVWhere(KV_HOST, 0.2))
    s.route = decode_pb2.Route(l_hist=100, l_incr=20, kv_state="host", prefill_worker="p0")
    assert kvwhere.route_holds(s) and not kvwhere.route_holds(s, fetch_first=True)
    s.route = decode_pb2.Route(l_hist=100, l_incr=20, kv_state="host")  # local: costed serially anyway
    assert kvwhere.route_holds(s, fetch_first=True)


def test_the_coordinator_routes_with_the_tasks_kv_fetch_first(decided):
    r = routes()
    posted: list = []
    r.run.control, r.run.secret, r.run.svc.counters = NS(post=posted.append), "", Counter()
    need = common_pb2.PrefillTask(session_id="s1", round=2, l_hist=10, l_incr=5, kv_state="host", kv_fetch_s=0.25,
                                  kv_fetch_first=True)
    asyncio.run(r.route(need))
    assert decided[-1].kv_fetch_first and decided[-1].kv_fetch_s == 0.25
    need = common_pb2.PrefillTask(session_id="s1", round=3, l_hist=10, l_incr=5, kv_state="host", kv_fetch_s=0.25)
    asyncio.run(r.route(need))  # a worker that predates it, or a claimed copy: the overlap
    assert not decided[-1].kv_fetch_first
    need = common_pb2.PrefillTask(session_id="s1", round=4, l_hist=10, l_incr=5, kv_fetch_first=True)
    asyncio.run(r.route(need))  # resident KV has no fetch to put first
    assert not decided[-1].kv_fetch_first


def test_a_round_that_fetched_first_sends_where_its_kv_is_as_its_task_goes_out():
    """Its task goes out after it waited for its fetch (``LiveTier.defer``): the router is told what
    is left of the fetch then, not the whole fetch it found as it first tried to start (the prefill
    slack and the decode-slack TTFT would count a fetch already done)."""
    w = worker()
    claims: dict = {}
    w.tier.reads = NS(get=lambda sess: claims.get(sess.session_id))
    w.core.tier.host.offload_begin("s1", 300)
    w.core.tier.host.offload_done("s1")
    s = session(fetch=300)
    kvwhere.note(w, s)  # the round tries to start: on host, its whole fetch (0.3 s) ahead
    assert kvwhere.send_fields(w, s, 2, 0.0) == {"kv_state": KV_HOST, "kv_fetch_s": pytest.approx(0.3),
                                                 "kv_fetch_first": True}
    s.core.fetch = 0  # admitted: the prefetch runs (began at 5.0)
    w.core.tier.host.prefetch_begin("s1")
    w.core.tier.host.prefetch_done("s1")
    w.tier.fetch_began["s1"] = (5.0, 300)
    got = kvwhere.send_fields(w, s, 2, 5.1)
    assert got == {"kv_state": KV_HOST, "kv_fetch_s": pytest.approx(0.2), "kv_fetch_first": True}
    del w.tier.fetch_began["s1"]  # the fetch ended: the task says resident
    assert kvwhere.send_fields(w, s, 2, 5.4) == {}
    assert kvwhere.round_where(s, 2).state == KV_HOST  # (the round's own record keeps where it started)
    claims["s1"] = object()  # claimed: sent while the fetch runs, with the location it started with
    assert kvwhere.send_fields(w, s, 2, 5.4) == {"kv_state": KV_HOST, "kv_fetch_s": pytest.approx(0.3)}
