"""The live decode worker's first rounds waiting for arriving prefix blocks (services/decode/prefixwait.py),
on a stand-in worker: a real pool, index (``LivePrefix``) and ``PrefixWaits``; the worker's rounds are
recorded, not run."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from ampd.kv import KVPool
from ampd.v1 import common_pb2
from ampd.worker import DecodeSession
from services.decode.prefix import LivePrefix
from services.decode.session import Session

T_TOKEN = 0.01  # the stand-in cost model's prefill time a new token: its own prompt (13 tokens) 0.13 s


def _worker():
    pool = KVPool(32, 4, 8)
    cost = SimpleNamespace(t_pre=lambda tp, hist, new: new * T_TOKEN)
    w = SimpleNamespace(rt=SimpleNamespace(pool=pool, cfg=SimpleNamespace(ttft_slo_s=10.0)),
                        core=SimpleNamespace(sessions={}, cost=cost, tp=1), tier=None,
                        metrics={"prefix_shared_tokens": 0, "prefix_waits": 0}, begun=[], failed=[])
    w.core.shared_history = lambda c, n: None
    w.begin_round = lambda s, params, new, input_ready: w.begun.append(s.session_id)
    w.fail = lambda s, error: w.failed.append((s.session_id, error))
    w.prefix = LivePrefix(w, True)
    return pool, w


def _session(w, sid: str, extra: int) -> Session:
    s = Session(session_id=sid, max_rounds=0, max_output=0, kv=w.prefix.new_kv(sid), core=DecodeSession(sid))
    s.tokens = list(range(100, 112)) + [extra]  # three full blocks every session shares, and its own token
    s.turn = common_pb2.Turn()
    return s


def _writing(w) -> Session:
    """Session ``a`` begins here: its prefill writes the three blocks, due in 0.01 s (its own
    prefill of them would take 0.13 s)."""
    a = _session(w, "a", 1)
    w.prefix.share(a)
    waits = w.prefix.waits
    waits.landing.writing(a.kv.session_id, waits.landing.writers[a.kv.session_id].hashes, time.monotonic() + T_TOKEN)
    return a


def _defer(w, s: Session) -> bool:
    return w.prefix.waits.defer(s, common_pb2.SamplingParams(), len(s.tokens), time.time())


def _publish(pool: KVPool, w, a: Session) -> None:
    a.kv.reserve(pool, len(a.tokens))
    a.kv.commit(len(a.tokens))
    w.prefix.published(a)


async def test_a_waiting_session_closed_during_its_wait_stops_waiting_and_never_begins():
    pool, w = _worker()
    a = _writing(w)
    b = _session(w, "b", 2)
    waits = w.prefix.waits
    assert _defer(w, b) and w.metrics["prefix_waits"] == 1 and b.prefix_waited
    timer = waits.deferred[b.kv.session_id].timer
    b.closed = True
    waits.done(b)  # (what the worker's close does, cancelled or closed)
    assert not waits.deferred and not waits.landing.waiting and timer.cancelled()
    assert waits.landing.writers[a.kv.session_id].waiters == []
    _publish(pool, w, a)
    await asyncio.sleep(0.1)  # past the bound (0.065 s) and the writer's landing
    assert w.begun == [] and w.failed == [] and waits.landing.empty()


async def test_the_writers_blocks_landing_begin_its_waiters_once_and_not_a_closed_one():
    pool, w = _worker()
    a = _writing(w)
    b, c = _session(w, "b", 2), _session(w, "c", 3)
    waits = w.prefix.waits
    assert _defer(w, b) and _defer(w, c) and w.metrics["prefix_waits"] == 2
    _publish(pool, w, a)  # its first token: the blocks enter the index, b and c begin again soon
    assert waits.landing.empty() and set(waits.deferred) == {b.kv.session_id, c.kv.session_id}
    c.closed = True  # closed before its retry runs
    await asyncio.sleep(0.1)  # past the bound: the timers were cancelled
    assert w.begun == ["b"] and w.failed == [] and not waits.deferred
    assert not _defer(w, _session(w, "d", 4))  # nothing being written now: no wait


async def test_the_bound_passing_begins_the_round_and_the_writers_landing_then_does_nothing():
    pool, w = _worker()
    a = _writing(w)
    b = _session(w, "b", 2)
    waits = w.prefix.waits
    assert _defer(w, b)
    await asyncio.sleep(0.1)  # the writer is late: the bound (half of b's own prefill, 0.065 s) passes
    assert w.begun == ["b"] and not waits.deferred and not waits.landing.waiting
    assert waits.landing.writers[a.kv.session_id].waiters == []
    assert not _defer(w, b)  # it waits once
    _publish(pool, w, a)
    await asyncio.sleep(0.01)
    assert w.begun == ["b"] and waits.landing.empty()
