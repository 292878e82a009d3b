"""The live decode worker's side of routing by the KV's location (``ampd.policy.kvwhere``): where a
session's KV is, read from the core's tier state and the host tier's moves in flight, for the round's
PrefillTask, the turn's TurnEnd, and whether the coordinator's Route still holds.

The round's location is taken once, as its start is first tried (``note``, from ``LiveTier.defer``).
The task says where the KV was when the round's input was ready and what its fetch back to the device
costs (``kv_fetch_s``). A local prefill starts once the fetch is done; a remote one reads the history
from the host copy while the fetch runs (services/decode/hostread.py), so the router counts Eq. (1)
plus the fetch against the later of Eq. (2) and the fetch, as the simulator does. A round whose copy
cannot be claimed (hostread.py) waits for its fetch before its task goes out, so its task says where
the KV is as it goes out (``send_fields``): what is left of the fetch (``kv_fetch_first``: the router
counts it and then Eq. (2)), or, the fetch done, resident: the router's absolute checks (prefill
slack, the decode-slack TTFT) must not count a fetch already behind it. The simulator routes such a
round as its input is ready, before its fetch (ampd/sim/tiering.py), with the whole fetch ahead of
it. A route sent ahead for such a round to a prefill worker, costed with the overlap, does not hold
(``route_holds``)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ampd.policy.kvtier import KVState, host_transfer_s
from ampd.policy.kvwhere import RESIDENT, KVWhere, KVWhereError, kv_where, parse_kv_where
from ampd.policy.types import KV_GONE, KV_HOST
from ampd.v1 import common_pb2

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.worker import DecodeWorker

__all__ = ["now_where", "note", "round_where", "fetch_first", "task_fields", "send_fields", "turn_end",
           "route_holds"]


def _state(w: DecodeWorker, s: Session) -> KVState:
    """The core's location of the session's KV (resident without a tier, or gone when a move failed)."""
    if s.recompute:
        return KVState.GONE
    tier = w.core.tier
    return KVState.RESIDENT if tier is None else tier.host.state(s.session_id)


def now_where(w: DecodeWorker, s: Session, now: float) -> KVWhere:
    """Where the KV of ``s`` is at ``now``: the core's state, its tokens still on host (``fetch``) and
    the live tier's prefetch in flight, timed by the profile's host transfer time."""
    core = w.core
    began = w.tier.fetch_began.get(s.session_id) if w.tier is not None else None
    since, moving = began if began is not None else (None, 0)
    return kv_where(_state(w, s), s.core.fetch, lambda n: host_transfer_s(core.cost, n, core.tp),
                    moving_tokens=moving, moving_since=since, now=now)


def note(w: DecodeWorker, s: Session) -> None:
    """The round's start is tried (``LiveTier.defer``, before any wait): its KV's location, kept for
    the round (the first try's: a round started after its fetch was on host all the same)."""
    if s.where is None or s.where[0] != s.round:
        s.where = (s.round, now_where(w, s, time.time()))


def round_where(s: Session, rnd: int) -> KVWhere:
    """The location the round started with (``note``); resident when none was taken (no tier)
    unless its history is prefilled again."""
    if s.where is not None and s.where[0] == rnd:
        return s.where[1]
    if s.timing is not None and s.timing.kv_recomputed_tokens:
        return KVWhere(KV_GONE, 0.0)
    return RESIDENT


def fetch_first(w: DecodeWorker, s: Session) -> bool:
    """The round of ``s`` started with its KV on host and did not claim its host copy (hostread.py):
    it waits for the fetch before any prefill, here or remote (``PrefillTask.kv_fetch_first``)."""
    return (round_where(s, s.round).state == KV_HOST
            and (w.tier is None or w.tier.reads.get(s) is None))


def task_fields(s: Session, rnd: int) -> dict:
    """The PrefillTask's kv_state/kv_fetch_s for round ``rnd`` as it started (nothing when resident
    with no wait); a round that fetches first goes through ``send_fields``."""
    return _fields(round_where(s, rnd), False)


def _fields(where: KVWhere, fetch_first: bool) -> dict:
    """kv_state/kv_fetch_s of ``where``, and kv_fetch_first when ``fetch_first`` (on host only)."""
    if where == RESIDENT:
        return {}
    out = {"kv_state": where.state, "kv_fetch_s": where.fetch_s}
    if fetch_first and where.state == KV_HOST:
        out["kv_fetch_first"] = True
    return out


def send_fields(w: DecodeWorker, s: Session, rnd: int, now: float) -> dict:
    """``task_fields`` of round ``rnd`` of ``s`` as its task goes out at ``now``: the location it started
    with, but for a round that fetched first (``fetch_first``), which went out after waiting for
    its fetch: where its KV is now (the fetch left, or resident once it ended)."""
    if fetch_first(w, s):
        return _fields(now_where(w, s, now), True)
    return task_fields(s, rnd)


def turn_end(w: DecodeWorker, s: Session, reason: str) -> common_pb2.TurnEnd:
    """The turn's TurnEnd, with where the tier left the session's KV (its decision just made)."""
    te = common_pb2.TurnEnd(round=s.round, finish_reason=reason, history_tokens=len(s.tokens))
    if w.tier is not None:
        where = now_where(w, s, time.time())
        if where != RESIDENT:
            te.kv_state, te.kv_fetch_s = where.state, where.fetch_s
    return te


def route_holds(s: Session, fetch_first: bool = False) -> bool:
    """The coordinator's route for the round starting now holds: decided for the sizes it has and
    for the KV location it found (decode.proto Route.kv_state; a route decided for resident KV that
    was on host would have been costed without the fetch). A remote route for a round that fetched
    first (``fetch_first``) was costed with the fetch overlapping it: the coordinator routes again."""
    r = s.route
    if r is None or (r.l_hist, r.l_incr) != (s.l_hist, s.l_incr) or (fetch_first and r.prefill_worker):
        return False
    try:
        told = parse_kv_where(r.kv_state, 0.0, "route.kv_state").state
    except KVWhereError:
        return False
    return told == round_where(s, s.round).state

