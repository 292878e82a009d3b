"""One session's prefill routing on the coordinator: each round's prefill placed by the router
(Algorithm 1) on the cluster's view, run locally or submitted to a prefill worker, and run locally
instead when that worker is lost.

A client's turn goes to the decode worker with its first round already routed (decode.proto Route,
``route_ahead``); a round the worker asks about (its prefill_task) is routed then (``route``)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import structlog

from ampd import tracing
from ampd.policy import PrefillTask, RouteDecision
from ampd.policy.kvwhere import RESIDENT, KVWhere, KVWhereError, parse_kv_where
from ampd.policy.types import KV_GONE, KV_HOST, KV_RESIDENT
from ampd.v1 import common_pb2, decode_pb2
from services.coordinator.core import route

if TYPE_CHECKING:
    from services.coordinator.session import SessionRun

log = structlog.get_logger()


class RouteAhead(NamedTuple):
    """The route sent with the client's last turn: its round's first Tokens show it held."""
    round: int
    decision: RouteDecision
    decide_ms: float
    input_ready: float  # when the turn went (the round's input was ready)


class RoundRoute(NamedTuple):
    """Where a round's prefill ran, after fallbacks (its RoundTiming's route_reason)."""
    target: str
    reason: str
    local: bool


class SessionRoutes:
    """The session's routed rounds (``routes``), those submitted to a prefill worker and not yet
    answered (``remote``: round -> prefill worker), the route sent ahead with the last turn, and
    where the last TurnEnd said the session's KV went (``told``: (decode worker, location), for the
    next turn's route only)."""

    __slots__ = ("run", "routes", "remote", "ahead", "told")

    def __init__(self, run: SessionRun) -> None:
        self.run = run
        self.routes: dict[int, RoundRoute] = {}
        self.remote: dict[int, str] = {}
        self.ahead: RouteAhead | None = None
        self.told: tuple[str, KVWhere] | None = None

    def reason(self, rnd: int) -> str | None:
        r = self.routes.get(rnd)
        return None if r is None else r.reason

    async def decide(self, rnd: int, l_hist: int, l_incr: int, input_ready: float, kv_state: str = KV_RESIDENT,
                     kv_fetch_s: float = 0.0, kv_fetch_first: bool = False):
        """(Algorithm 1's decision or None, ms it took) for the round on the cluster's view now.
        ``kv_state``/``kv_fetch_s``: where the session's KV is on its decode worker's host KV tier
        (``PrefillTask``: its prefill_task's, or for a route sent ahead its last TurnEnd's);
        ``kv_fetch_first``: the prefill_task's (a route sent ahead assumes the overlap)."""
        run = self.run
        svc = run.svc
        t0 = time.perf_counter()
        view = await svc.cluster.view()
        svc.route_read_ms_total += view.read_s * 1e3
        req = PrefillTask(run.sid, rnd, l_hist, l_incr, input_ready, run.decode_id, run.info.tp, kv_state, kv_fetch_s,
                          kv_fetch_first=kv_fetch_first and kv_state == KV_HOST)
        try:
            now = time.time()
            decision = route(svc.router, view, req, now)
            svc.cluster.routed(view, req, decision, now)
        except LookupError:  # the bound worker left routing meanwhile: its stream says what happened
            decision = None
        took = time.perf_counter() - t0
        if tracing.on and decision is not None:
            end = time.time()
            tracing.route_span(run.sid, rnd, decision, end - took, end, l_hist, l_incr)
        return decision, took * 1e3

    async def route_ahead(self, rnd: int, l_hist: int, l_incr: int) -> decode_pb2.Route | None:
        """Routes the first round of a client's turn as the turn goes to the decode worker, for the
        sizes it will have there if it holds the session's KV (decode.proto Route): the worker then
        starts a local prefill, or submits a remote one to its prefill worker, without a round trip
        through here. The decision is Algorithm 1's on the view it would read a moment later, when
        the worker's prefill_task came."""
        self.drop_ahead()
        where = self.take_told()
        if where.state == KV_GONE:  # the worker prefills the history again
            l_hist, l_incr = 0, l_hist + l_incr
        now = time.time()
        decision, decide_ms = await self.decide(rnd, l_hist, l_incr, now, where.state, where.fetch_s)
        if decision is None:
            return None
        self.ahead = RouteAhead(rnd, decision, decide_ms, now)
        if not decision.local:  # the decode worker submits it: a lost prefill worker's rounds re-route
            self.remote[rnd] = decision.target
            self.run.svc.remember_remote(self.run, decision.target, rnd)
        return decode_pb2.Route(l_hist=l_hist, l_incr=l_incr,
                                prefill_worker="" if decision.local else decision.target,
                                kv_state="" if where.state == KV_RESIDENT else where.state)

    def heard(self, te: common_pb2.TurnEnd) -> common_pb2.TurnEnd:
        """The session's TurnEnd from its decode worker: where its KV went is kept for the next
        turn's route (once), and the TurnEnd goes on without it (a location is the worker's, of
        that moment: neither the client nor a later route reuses it)."""
        self.told = None
        if te.kv_state or te.kv_fetch_s:
            try:
                self.told = (self.run.decode_id, parse_kv_where(te.kv_state, te.kv_fetch_s, "turn_end.kv_state"))
            except KVWhereError as exc:
                log.warning("turn end with a bad KV location; routing as resident", session=self.run.sid,
                            error=str(exc))
            out = common_pb2.TurnEnd()
            out.CopyFrom(te)
            out.ClearField("kv_state")
            out.ClearField("kv_fetch_s")
            return out
        return te

    def take_told(self) -> KVWhere:
        """Where the last TurnEnd said the KV went, if on the worker the session is bound to now;
        forgotten as it is read."""
        told, self.told = self.told, None
        return told[1] if told is not None and told[0] == self.run.decode_id else RESIDENT

    def drop_ahead(self) -> None:
        """The route sent with the turn did not hold (the worker asked with a prefill_task)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and not ahead.decision.local:
            self.run.svc.forget_remote(self.run, ahead.round)

    def held(self, rnd: int) -> RouteAhead | None:
        """Round ``rnd``'s first tokens came: the route sent ahead for it, if it held (no
        prefill_task came), counted as routed; None otherwise."""
        ahead = self.ahead
        if ahead is None or ahead.round != rnd:
            return None
        self.ahead = None
        counters = self.run.svc.counters
        counters[f"route_{ahead.decision.reason}"] += 1
        counters["prefills_local" if ahead.decision.local else "prefills_remote"] += 1
        counters["prefills_routed_with_turn"] += 1
        return ahead

    async def route(self, need: common_pb2.PrefillTask) -> None:
        """Routes the round the decode worker asked about, and runs it where the decision says."""
        run = self.run
        svc = run.svc
        # Asked again about a round routed here to a prefill worker: the decode worker's submit there
        # failed (decode.proto remote_prefill). The round runs on the decode worker: a prefill worker
        # that vanished must not lose it. (A route sent with the turn that did not hold is routed
        # again: the worker may not have submitted it at all.)
        ahead = self.ahead is not None and self.ahead.round == need.round
        failed = None if ahead else self.remote.get(need.round)
        self.drop_ahead()
        svc.forget_remote(run, need.round)
        if failed is not None:
            log.warning("remote prefill submit failed; running locally", session=run.sid, round=need.round,
                        target=failed)
            svc.counters["route_fallback-local"] += 1
            # out of routing until it publishes again (Cluster.mark_lost): the next rounds go elsewhere
            svc.cluster.mark_lost(failed)
            self.local(need.round, "fallback-local")
            self.routes[need.round] = RoundRoute(run.decode_id, "fallback-local", True)
            return
        try:
            where = parse_kv_where(need.kv_state, need.kv_fetch_s, "prefill_task.kv_state")
        except KVWhereError as exc:  # a worker's mistake: the round is routed as if resident
            log.warning("prefill task with a bad KV location; routing as resident", session=run.sid,
                        round=need.round, error=str(exc))
            where = RESIDENT
        decision, decide_ms = await self.decide(need.round, need.l_hist, need.l_incr, need.input_ready,
                                                where.state, where.fetch_s, need.kv_fetch_first)
        if decision is None:
            self.local(need.round, "fallback-local")
            return
        svc.counters[f"route_{decision.reason}"] += 1
        if decision.local:
            self.local(need.round, decision.reason)
        else:
            self._remote(need.round, decision.target, decision.reason)
        self.routed(need.round, decision, decide_ms)

    def _remote(self, rnd: int, worker: str, reason: str) -> None:
        """The round's prefill runs on prefill worker ``worker``: the decode worker, which holds its
        prefill_task, submits it there (a message from here, not the task and its reply)."""
        run = self.run
        self.remote[rnd] = worker
        run.svc.remember_remote(run, worker, rnd)
        run.control.post(decode_pb2.ControlRequest(remote_prefill=decode_pb2.RouteInfo(
            session_id=run.sid, round=rnd, reason=reason, prefill_worker=worker, session_secret=run.secret)))
        run.svc.counters["prefills_remote"] += 1

    def routed(self, rnd: int, decision: RouteDecision, decide_ms: float) -> None:
        """Round ``rnd``'s prefill went where ``decision`` says (after fallbacks)."""
        self.routes[rnd] = RoundRoute(decision.target, decision.reason, decision.local)
        # (no Redis write a round: the session's record holds what a move or a reattach needs, its
        # binding; a write a round took ~5% of the coordinator's CPU, benchmarks/coordinator_capacity.py).
        # Its line is at debug (AMPD_LOG_LEVEL=debug): rendered and written every round it cost ~3% of
        # the coordinator's CPU; the reason stays in the round's RoundTiming.route_reason, the
        # ampd_route_decisions_total counter and the route span.
        if log.is_enabled_for(logging.DEBUG):  # (its arguments cost even when the line is dropped)
            log.debug("route", session=self.run.sid, round=rnd, target=decision.target, local=decision.local,
                      reason=decision.reason, decide_ms=round(decide_ms, 3),
                      **{k: round(v, 4) for k, v in decision.estimates.items()})

    def local(self, rnd: int, reason: str) -> None:
        """The round's prefill runs on the bound decode worker. Unanswered (decode.proto Control): a
        worker that refuses it has lost the session or ended the round, which its events show."""
        run = self.run
        run.control.post(decode_pb2.ControlRequest(local_prefill=decode_pb2.RouteInfo(
            session_id=run.sid, round=rnd, reason=reason, session_secret=run.secret)))
        run.svc.counters["prefills_local"] += 1

    async def reroute(self, rnd: int, lost: str) -> None:
        """The prefill worker running round ``rnd``'s prefill is lost: the decode worker, which still
        holds the KV it reserved for it, runs it instead (refused if it got the result meanwhile)."""
        run = self.run
        if self.remote.get(rnd) != lost or run.control is None:
            return
        del self.remote[rnd]
        run.svc.counters["prefills_rerouted"] += 1
        log.warning("prefill worker lost; running the prefill on the decode worker", session=run.sid,
                    round=rnd, prefill_worker=lost)
        self.local(rnd, "rerouted")
        if rnd in self.routes:
            self.routes[rnd] = RoundRoute(run.decode_id, "rerouted", True)
